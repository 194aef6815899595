"""Builds ft and its C++ extension ft._C.

    python setup.py build_ext --inplace          # in-tree build
    pip install --no-build-isolation -e .        # editable install

torch must already be installed (the extension compiles against it), hence
--no-build-isolation. A CUDA torch adds the NCCL sources (FT_USE_NCCL).
"""
import glob
import os
import subprocess
import sys

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def torch_version():
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def extension():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    nccl_sources = [s for s in sources if os.path.basename(s).startswith("nccl_")]
    sources = [s for s in sources if s not in nccl_sources]
    # Python's CFLAGS add -g: a 15 MB .so and a slower build.
    cxx_flags = ["-O2", "-g0", "-std=c++20"]
    define_macros = []
    include_dirs = []
    library_dirs = []
    libraries = []
    if torch_version() >= (2, 14):
        # Backend::rank_/size_ became assignable alongside the upstream
        # reconfigure API.
        define_macros.append(("C10D_BACKEND_HAS_RECONFIGURE", "1"))
    use_nccl = torch.version.cuda is not None and os.environ.get("FT_USE_NCCL", "1") != "0"
    if use_nccl:
        import nvidia.nccl  # the NCCL wheel torch depends on

        nccl_root = os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0]
        define_macros.append(("FT_USE_NCCL", "1"))
        sources += nccl_sources
        include_dirs += [os.path.join(nccl_root, "include"), "/usr/local/cuda/include"]
        library_dirs.append(os.path.join(nccl_root, "lib"))
        libraries.append(":libnccl.so.2")
    return CppExtension(
        name="ft._C",
        sources=sources,
        define_macros=define_macros,
        include_dirs=include_dirs,
        library_dirs=library_dirs,
        libraries=libraries,
        extra_compile_args={"cxx": cxx_flags},
    )


def generate_proto():
    script = os.path.join(ROOT, "tools", "gen_proto.py")
    if os.path.exists(script):
        subprocess.check_call([sys.executable, script])


class Build(BuildExtension):
    def run(self):
        generate_proto()
        super().run()


setup(
    name="ft",
    version="0.1.0",
    description="Per-step fault tolerance for PyTorch training",
    packages=find_packages(include=["ft", "ft.*"]),
    package_data={"ft": ["coordination/dashboard/*", "coordination/_proto/*"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": Build.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11,<2.15",
        "grpcio>=1.60",
        "protobuf>=4.25",
        "numpy",
    ],
    extras_require={"test": ["pytest", "hypothesis", "grpcio-tools", "ninja"]},
    entry_points={
        "console_scripts": [
            "ft-lighthouse=ft.coordination.cli:main",
            "ft-launch=ft.launch.cli:main",
        ]
    },
)
