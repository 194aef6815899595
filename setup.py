"""Builds ft and its C++ extensions: ft._C (the backend) and, where the system has gRPC C++
(pkg-config grpc++, e.g. Debian's libgrpc++-dev), ft.coordination._grpc_server (the
lighthouse's native gRPC server; without it the lighthouse serves with grpcio).

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


def find_nccl():
    """(include dir, lib dir) of the NCCL wheel torch depends on.

    nvidia.nccl is a namespace package (no __file__) and its __path__ may list
    a folder twice; cu13 wheels may also nest it as nvidia/cu13. Search every
    candidate for nccl.h and libnccl.so.2.
    """
    roots = []
    try:
        import nvidia  # noqa: F401

        for base in list(nvidia.__path__):
            roots += [os.path.join(base, "nccl"), os.path.join(base, "cu13"),
                      os.path.join(base, "cu12")]
    except ImportError:
        pass
    roots.append(os.environ.get("NCCL_HOME", "/usr"))
    for root in roots:
        inc, lib = os.path.join(root, "include"), os.path.join(root, "lib")
        if os.path.exists(os.path.join(inc, "nccl.h")) and os.path.exists(
            os.path.join(lib, "libnccl.so.2")
        ):
            return inc, lib
    raise RuntimeError(
        "ft: CUDA torch found but no NCCL headers/library (looked in %s); "
        "install the nvidia-nccl wheel or set FT_USE_NCCL=0" % ", ".join(roots)
    )


def find_cuda_home():
    from torch.utils.cpp_extension import CUDA_HOME

    for home in (os.environ.get("CUDA_HOME"), CUDA_HOME, "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    raise RuntimeError("ft: CUDA torch found but no CUDA toolkit (set CUDA_HOME)")


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
        nccl_include, nccl_lib = find_nccl()
        cuda_home = find_cuda_home()
        define_macros.append(("FT_USE_NCCL", "1"))
        sources += nccl_sources
        include_dirs += [nccl_include, os.path.join(cuda_home, "include")]
        library_dirs += [nccl_lib, os.path.join(cuda_home, "lib64")]
        # torch has already loaded libnccl.so.2 and libcudart.so.13 by the time
        # ft._C is imported (import ft imports torch first), so no rpath.
        libraries += [":libnccl.so.2", "c10_cuda", "cudart"]
    return CppExtension(
        name="ft._C",
        sources=sources,
        define_macros=define_macros,
        include_dirs=include_dirs,
        library_dirs=library_dirs,
        libraries=libraries,
        extra_compile_args={"cxx": cxx_flags},
    )


def grpc_server_extension():
    """ft.coordination._grpc_server, or None without gRPC C++ (or with FT_NATIVE_GRPC=0)."""
    if os.environ.get("FT_NATIVE_GRPC", "1") == "0":
        return None
    try:
        cflags = subprocess.check_output(["pkg-config", "--cflags", "grpc++", "libcrypto"], text=True).split()
        libs = subprocess.check_output(["pkg-config", "--libs", "grpc++", "libcrypto"], text=True).split()
    except (OSError, subprocess.CalledProcessError):
        print("ft: gRPC C++ or OpenSSL not found (pkg-config grpc++ libcrypto): the lighthouse will use grpcio")
        return None
    from setuptools import Extension
    from torch.utils.cpp_extension import include_paths

    # pybind11's headers come with torch; the module itself does not link torch.
    return Extension(
        name="ft.coordination._grpc_server",
        sources=["csrc/grpc_server/grpc_server.cpp"],
        include_dirs=include_paths()[:1],
        extra_compile_args=["-O2", "-g0", "-std=c++17", "-fvisibility=hidden"] + cflags,
        extra_link_args=libs,
        language="c++",
    )


def generate_proto():
    script = os.path.join(ROOT, "tools", "gen_proto.py")
    if not os.path.exists(script):
        return
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        # e.g. the GPU machine (no package index): keep the checked-in stubs.
        if glob.glob(os.path.join(ROOT, "ft", "coordination", "_proto", "*_pb2.py")):
            print("ft: grpc_tools not installed; using the checked-in proto stubs")
            return
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
    ext_modules=[e for e in (extension(), grpc_server_extension()) if e is not None],
    cmdclass={"build_ext": Build.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11,<2.15",
        "grpcio>=1.64.0",
        "protobuf>=4.25.0",
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
