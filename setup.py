"""Builds ft's C++ extensions; the package's static metadata is in pyproject.toml.

    python setup.py build_ext --inplace          # in-tree build (scripts/setup.sh)
    pip install --no-build-isolation .           # install, against the torch already installed
    pip install .                                # install, torch for the build chosen by pip

Extensions:
* ``ft._C``, the torch backend. It compiles against the torch found at build time; a CUDA torch
  adds the NCCL sources.
* ``ft.coordination._grpc_server``, the native gRPC server and client, where gRPC C++ and
  OpenSSL are installed (``pkg-config grpc++ libcrypto``, e.g. Debian's libgrpc++-dev and
  libssl-dev). It compiles with pybind11's own headers (``pybind11.get_include()``) and links
  gRPC C++ and libcrypto, not torch. Without it the lighthouse serves, and clients call, with
  grpcio (slower: the build then ends with a WARNING saying what was missing).

Build switches (docs/building.md, "Build switches"; environment; 1/ON/YES/TRUE and 0/OFF/NO/FALSE, as PyTorch's):

    USE_CUDA=0                 no CUDA/NCCL path even against a CUDA torch
    USE_NCCL=0                 no NCCL path (FT_USE_NCCL=0 is an alias)
    NCCL_INCLUDE_DIR, NCCL_LIB_DIR, NCCL_HOME
                               where NCCL is: the two dirs, else NCCL_HOME/include with
                               NCCL_HOME/lib or NCCL_HOME/lib64, else the nvidia-nccl wheel
                               torch depends on, else the system (/usr)
    CUDA_HOME                  the CUDA toolkit (headers) for the NCCL path
    MAX_JOBS=N                 parallel compile jobs (torch's ninja build reads it)
    DEBUG=1                    -O0 -g (REL_WITH_DEB_INFO=1: -O2 -g); default -O2, no symbols
    FT_NATIVE_GRPC=0|1         native gRPC server off, or on and required (default: on where
                               gRPC C++ is found; a build without it ends with a WARNING)
    FT_WHEEL_NATIVE_GRPC=0     leave the native gRPC server out of a wheel (bdist_wheel, so
                               also `pip install .`); scripts/build_wheel.sh bundles gRPC C++
                               into the wheels it makes (auditwheel)
    FT_BUILD_EXTENSIONS=0      pure-Python install, torch not imported (the lighthouse
                               image: examples/deploy/Dockerfile.lighthouse)

Requirements: a wheel (and the metadata pip prepares for one) requires ``torch==X.Y.*``, the
major.minor it was compiled against, since torch's C++ ABI changes between minor releases; the
sdist declares the range of pyproject.toml and marks Requires-Dist dynamic (PEP 643).
"""

import atexit
import glob
import os
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.egg_info import egg_info as _EggInfo

ROOT = os.path.dirname(os.path.abspath(__file__))

_TRUE = ("1", "ON", "YES", "TRUE", "Y")
_FALSE = ("0", "OFF", "NO", "FALSE", "N", "")


def env_flag(name, default=None):
    """True/False from the environment variable ``name``, ``default`` where it is unset."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value.strip().upper() in _TRUE:
        return True
    if value.strip().upper() in _FALSE:
        return False
    raise SystemExit(f"ft: {name}={value!r} is neither on (1/ON/YES/TRUE) nor off (0/OFF/NO/FALSE)")


# The commands this run of setup.py was given (PEP 517 backends call it the same way), with
# the values of their options (harmless: only command names are looked up).
COMMANDS = {a for a in sys.argv[1:] if not a.startswith("-")}
# Commands that make something installable, whose metadata carries the torch pin.
INSTALLABLE_COMMANDS = {
    "bdist_wheel",
    "dist_info",
    "editable_wheel",
    "develop",
    "install",
    "bdist_egg",
    "bdist",
}
BUILDING_WHEEL = "bdist_wheel" in COMMANDS
BUILD_EXTENSIONS = env_flag("FT_BUILD_EXTENSIONS", True)

torch = None
if BUILD_EXTENSIONS:
    try:
        import torch
    except ImportError:
        if COMMANDS & {
            "build",
            "build_ext",
            "bdist_wheel",
            "bdist",
            "bdist_egg",
            "develop",
            "install",
            "editable_wheel",
        }:
            raise SystemExit(
                "ft: the extension compiles against torch, which is not installed here. Install "
                "torch first and build with --no-build-isolation, or let pip build with build "
                "isolation (pip install .), or set FT_BUILD_EXTENSIONS=0 for a pure-Python "
                "install (no backend; the lighthouse only)."
            ) from None
        # An sdist needs no compiler and no torch: MANIFEST.in lists the sources.


def read_version():
    """ft/_version.py is the one place the release is written."""
    scope = {}
    with open(os.path.join(ROOT, "ft", "_version.py")) as f:
        exec(f.read(), scope)
    return scope["__version__"]


def torch_version():
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def optimization_flags():
    if env_flag("DEBUG", False):
        return ["-O0", "-g"]
    if env_flag("REL_WITH_DEB_INFO", False):
        return ["-O2", "-g"]
    # Python's CFLAGS add -g: a 15 MB .so and a slower build.
    return ["-O2", "-g0"]


def _has_nccl(inc, lib):
    return (
        inc
        and lib
        and os.path.exists(os.path.join(inc, "nccl.h"))
        and os.path.exists(os.path.join(lib, "libnccl.so.2"))
    )


def find_nccl():
    """(include dir, lib dir) of NCCL, searched in the order of the module docstring.

    nvidia.nccl is a namespace package (no __file__) and its __path__ may list a folder twice;
    cu13 wheels may also nest it as nvidia/cu13. Each candidate needs nccl.h and libnccl.so.2.
    """
    candidates = []
    inc_env, lib_env = os.environ.get("NCCL_INCLUDE_DIR"), os.environ.get("NCCL_LIB_DIR")
    if inc_env or lib_env:
        home = os.environ.get("NCCL_HOME", "/usr")
        inc = inc_env or os.path.join(home, "include")
        libs = [lib_env] if lib_env else [os.path.join(home, "lib"), os.path.join(home, "lib64")]
        found = [(inc, lib) for lib in libs if _has_nccl(inc, lib)]
        if not found:
            raise SystemExit(
                f"ft: no nccl.h in {inc} or no libnccl.so.2 in {', '.join(libs)} "
                "(NCCL_INCLUDE_DIR / NCCL_LIB_DIR)"
            )
        return found[0]
    if os.environ.get("NCCL_HOME"):
        home = os.environ["NCCL_HOME"]
        candidates += [
            (os.path.join(home, "include"), os.path.join(home, d)) for d in ("lib", "lib64")
        ]
    try:
        import nvidia  # noqa: F401

        for base in list(nvidia.__path__):
            for sub in ("nccl", "cu13", "cu12"):
                root = os.path.join(base, sub)
                candidates.append((os.path.join(root, "include"), os.path.join(root, "lib")))
    except ImportError:
        pass
    candidates += [
        ("/usr/include", d)
        for d in (
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
        )
    ]
    candidates.append(("/usr/local/include", "/usr/local/lib"))
    for inc, lib in candidates:
        if _has_nccl(inc, lib):
            return inc, lib
    raise SystemExit(
        "ft: CUDA torch found but no NCCL headers/library (looked in %s); install the "
        "nvidia-nccl wheel, set NCCL_HOME or NCCL_INCLUDE_DIR/NCCL_LIB_DIR, or build without "
        "NCCL (USE_NCCL=0)"
        % ", ".join(sorted({c[0] for c in candidates} | {c[1] for c in candidates}))
    )


def find_cuda_home():
    from torch.utils.cpp_extension import CUDA_HOME

    for home in (os.environ.get("CUDA_HOME"), CUDA_HOME, "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    raise SystemExit("ft: CUDA torch found but no CUDA toolkit (set CUDA_HOME, or USE_CUDA=0)")


def use_nccl():
    if torch.version.cuda is None:
        if env_flag("USE_NCCL") or env_flag("FT_USE_NCCL"):
            print("ft: USE_NCCL=1 ignored: torch %s is not a CUDA build" % torch.__version__)
        return False
    if env_flag("USE_CUDA", True) is False:
        return False
    return env_flag("USE_NCCL", True) and env_flag("FT_USE_NCCL", True)


def extension():
    from torch.utils.cpp_extension import CppExtension

    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    nccl_sources = [s for s in sources if os.path.basename(s).startswith("nccl_")]
    sources = [s for s in sources if s not in nccl_sources]
    cxx_flags = optimization_flags() + ["-std=c++20"]
    define_macros = []
    include_dirs = []
    library_dirs = []
    libraries = []
    if torch_version() >= (2, 14):
        # Backend::rank_/size_ became assignable alongside the upstream
        # reconfigure API.
        define_macros.append(("C10D_BACKEND_HAS_RECONFIGURE", "1"))
    if use_nccl():
        nccl_include, nccl_lib = find_nccl()
        cuda_home = find_cuda_home()
        define_macros.append(("FT_USE_NCCL", "1"))
        sources += nccl_sources
        include_dirs += [nccl_include, os.path.join(cuda_home, "include")]
        library_dirs += [nccl_lib, os.path.join(cuda_home, "lib64")]
        # torch has already loaded libnccl.so.2 and libcudart.so.13 by the time
        # ft._C is imported (ft._C is imported only after torch), so no rpath.
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


# The WARNINGs of this build (no_native_grpc), printed by build_ext.
BUILD_WARNINGS = []

NO_NATIVE_GRPC_COST = (
    "the lighthouse and the ManagerServers will serve, and their clients call, with grpcio "
    "(the fallback): quorum rounds about 2-3x slower, heartbeats about 4x the CPU "
    "(docs/benchmarks.md, \"Quorum and lighthouse\")"
)


def _pkg_config(*args):
    return subprocess.run(["pkg-config", *args], capture_output=True, text=True)


def missing_grpc_parts():
    """What of gRPC C++ and OpenSSL pkg-config cannot find, for the message (asked only after
    the combined query failed: each query costs seconds)."""
    try:
        _pkg_config("--version")
    except OSError:
        return ["pkg-config (the build finds gRPC C++ with it)"]
    missing = []
    for module, what in (("grpc++", "gRPC C++"), ("libcrypto", "OpenSSL's libcrypto")):
        if _pkg_config("--exists", module).returncode != 0:
            missing.append(f"{what} (pkg-config {module})")
    return missing or ["gRPC C++ or OpenSSL (pkg-config grpc++ libcrypto failed)"]


def no_native_grpc(missing, install):
    """Records the WARNING of a build without the native server: the build prints it when it
    starts compiling and again when the process ends (build_ext below)."""
    cost = NO_NATIVE_GRPC_COST[0].upper() + NO_NATIVE_GRPC_COST[1:]
    BUILD_WARNINGS.append(
        "WARNING: ft is built without its native gRPC server (ft.coordination._grpc_server): "
        f"{'; '.join(missing)} not found. {cost}. To build it: {install}, then rebuild; "
        "FT_NATIVE_GRPC=0 builds without it and without this warning."
    )


def print_build_warnings():
    for text in BUILD_WARNINGS:
        print(text, file=sys.stderr, flush=True)


def grpc_server_extension():
    """ft.coordination._grpc_server, or None (module docstring: FT_NATIVE_GRPC)."""
    wanted = env_flag("FT_NATIVE_GRPC")
    if wanted is False:
        print("ft: FT_NATIVE_GRPC=0: no native gRPC server; " + NO_NATIVE_GRPC_COST)
        return None
    if wanted is None and BUILDING_WHEEL and env_flag("FT_WHEEL_NATIVE_GRPC", True) is False:
        print(
            "ft: FT_WHEEL_NATIVE_GRPC=0: a wheel without the native gRPC server; "
            + NO_NATIVE_GRPC_COST
        )
        return None
    try:
        cflags = subprocess.check_output(
            ["pkg-config", "--cflags", "grpc++", "libcrypto"], text=True, stderr=subprocess.DEVNULL
        ).split()
        libs = subprocess.check_output(
            ["pkg-config", "--libs", "grpc++", "libcrypto"], text=True, stderr=subprocess.DEVNULL
        ).split()
    except (OSError, subprocess.CalledProcessError):
        if wanted:
            raise SystemExit(
                "ft: FT_NATIVE_GRPC=1 but gRPC C++ or OpenSSL was not found (pkg-config grpc++ libcrypto)"
            ) from None
        no_native_grpc(
            missing_grpc_parts(),
            "apt-get install libgrpc++-dev libssl-dev pkg-config (Debian/Ubuntu; elsewhere put "
            "their .pc files on PKG_CONFIG_PATH)",
        )
        return None
    try:
        import pybind11
    except ImportError:
        if wanted:
            raise SystemExit(
                "ft: FT_NATIVE_GRPC=1 but pybind11 is not installed (pip install pybind11)"
            ) from None
        no_native_grpc(["pybind11"], "pip install pybind11")
        return None
    return Extension(
        name="ft.coordination._grpc_server",
        sources=[
            "csrc/grpc_server/grpc_server.cpp",
            "csrc/grpc_server/grpc_client.cpp",
            "csrc/grpc_server/quorum_wire.cpp",
        ],
        depends=[
            "csrc/grpc_server/call_stream_wire.hpp",
            "csrc/grpc_server/grpc_client.hpp",
            "csrc/grpc_server/quorum_wire.hpp",
            "csrc/grpc_server/proto_wire.hpp",
            "csrc/grpc_server/request_auth.hpp",
            "csrc/grpc_server/steady_quorum.hpp",
        ],
        include_dirs=[pybind11.get_include()],
        extra_compile_args=optimization_flags() + ["-std=c++17", "-fvisibility=hidden"] + cflags,
        extra_link_args=libs,
        language="c++",
    )


def generate_proto():
    script = os.path.join(ROOT, "tools", "gen_proto.py")
    if not os.path.exists(script):
        return
    if os.path.exists(os.path.join(ROOT, "PKG-INFO")):
        # Building from an sdist: its stubs are the ones the release was tested with.
        return
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        # e.g. the GPU machine (no package index), or build isolation: keep the checked-in stubs.
        if glob.glob(os.path.join(ROOT, "ft", "coordination", "_proto", "*_pb2.py")):
            print("ft: grpc_tools not installed; using the checked-in proto stubs")
            return
    subprocess.check_call([sys.executable, script])


def requirements_for(dist):
    """install_requires for this run: pinned to the compiled-against torch where the run makes
    something installable from compiled code, else pyproject.toml's range."""
    reqs = [str(r) for r in dist.install_requires]
    if torch is None or not (COMMANDS & INSTALLABLE_COMMANDS):
        # A plain list (not setuptools' "static" one): PKG-INFO then says
        # "Dynamic: Requires-Dist", which is true, since wheels narrow torch.
        return reqs
    major, minor = torch_version()
    pinned = []
    for req in reqs:
        name = req.split(";")[0]
        for sep in "<>=!~ [(":
            name = name.split(sep)[0]
        pinned.append(f"torch=={major}.{minor}.*" if name.strip().lower() == "torch" else req)
    return pinned


class EggInfo(_EggInfo):
    """Every metadata writer (sdist's PKG-INFO, dist_info, bdist_wheel) runs egg_info."""

    def run(self):
        reqs = requirements_for(self.distribution)
        self.distribution.install_requires = reqs
        self.distribution.metadata.install_requires = reqs
        super().run()


cmdclass = {"egg_info": EggInfo}
ext_modules = []
if torch is not None:
    from torch.utils.cpp_extension import BuildExtension

    class Build(BuildExtension):
        def run(self):
            generate_proto()
            if BUILD_WARNINGS:
                print_build_warnings()
                # Again as the process ends: the last lines of the build's log (pip -v), after
                # the compiler's output and the wheel's packing.
                atexit.register(print_build_warnings)
            super().run()

    cmdclass["build_ext"] = Build.with_options(use_ninja=True)
    ext_modules = [e for e in (extension(), grpc_server_extension()) if e is not None]

setup(
    version=read_version(),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
