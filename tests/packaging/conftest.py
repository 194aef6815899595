"""Fixtures of the packaging tests: the sdist, and the wheel scripts/build_wheel.sh makes from
it (one compile, shared by test_sdist.py, test_wheel.py and test_lighthouse_image.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.packaging import _util


@pytest.fixture(scope="session")
def sdist(tmp_path_factory) -> Path:
    return _util.build_sdist(tmp_path_factory.mktemp("sdist"))


@dataclass
class BuiltWheel:
    wheel: Path  # the repaired wheel, alone in its folder (DIST)
    raw_wheel: Path  # the same before auditwheel repair: linked to the system's libraries
    check_venv: Path  # the fresh venv the script installed it into, with its dependencies
    native: bool  # built with the native gRPC server (where gRPC C++ is installed)
    output: str  # the script's stdout


def has_grpc_cpp() -> bool:
    return (
        shutil.which("pkg-config") is not None
        and subprocess.run(["pkg-config", "--exists", "grpc++", "libcrypto"]).returncode == 0
    )


@pytest.fixture(scope="session")
def built_wheel(sdist, tmp_path_factory) -> BuiltWheel:
    """``bash scripts/build_wheel.sh <the sdist>``: compiles ft._C and the native gRPC server
    from the sdist's sources alone, bundles gRPC C++ with auditwheel and checks the wheel in a
    fresh venv. On a machine without gRPC C++ the wheel is built without the native server
    (FT_WHEEL_NATIVE_GRPC=0), and the tests that need it skip."""
    _util.skip_unless_enabled()
    work = tmp_path_factory.mktemp("wheel-work")
    dist = tmp_path_factory.mktemp("wheelhouse")
    native = has_grpc_cpp()
    env = _util.clean_env(FT_WHEEL_WORK=str(work), DIST=str(dist))
    for name in ("FT_NATIVE_GRPC", "FT_WHEEL_NATIVE_GRPC"):
        env.pop(name, None)
    if not native:
        env["FT_WHEEL_NATIVE_GRPC"] = "0"
    r = _util.run(
        ["bash", _util.ROOT / "scripts" / "build_wheel.sh", sdist],
        cwd=_util.ROOT,
        env=env,
        timeout=1500,
    )
    print(f"scripts/build_wheel.sh {sdist.name}: {r.seconds:.0f}s")
    print("\n".join(line for line in r.stdout.splitlines() if line.startswith("[build_wheel")))
    (wheel,) = dist.glob("ft_torch-*.whl")
    assert os.listdir(dist) == [wheel.name]
    (raw,) = (work / "raw").glob("ft_torch-*.whl")
    return BuiltWheel(
        wheel=wheel, raw_wheel=raw, check_venv=work / "check", native=native, output=r.stdout
    )
