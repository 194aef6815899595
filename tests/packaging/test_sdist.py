"""The sdist holds everything a build needs, and builds, installs and runs from outside the
source tree.

How (the fastest honest way on a 2-core machine with no second copy of torch):
1. The sdist is built from the working tree by setuptools' PEP 517 hook ``build_sdist`` (what
   ``pip`` and ``python -m build`` call), then unpacked in a temporary folder.
2. A new venv is made with ``python -m venv --without-pip``, and a ``.pth`` file in it appends
   the test interpreter's site-packages to its sys.path: torch, grpcio, protobuf, setuptools,
   ninja and pybind11 come from there instead of being downloaded and unpacked again (torch
   alone is ~1 GB unpacked). The new venv's own site-packages comes first, and the test venv
   holds no ft (the suite imports ft from the source tree via sys.path, not an install).
3. ``pip install --no-build-isolation --no-deps <unpacked sdist>`` builds the wheel (compiling
   ft._C, and the native gRPC server where gRPC C++ is installed, from the sdist's sources
   only) and installs it into the new venv.
4. From a temporary folder, with no PYTHONPATH: ``import ft`` must come from the new venv, two
   processes allreduce on the "ft" backend, ``ft-lighthouse --help`` and ``ft-launch --help``
   run, and the installed metadata pins torch to the built-against major.minor.

Build time (2 cores, MAX_JOBS=2): see the README's Install section; the test fails past 15
minutes.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.packaging import _util

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="session")
def sdist(tmp_path_factory) -> Path:
    return _util.build_sdist(tmp_path_factory.mktemp("sdist"))


def _pkg_info(sdist: Path):
    with tarfile.open(sdist) as tar:
        (member,) = [
            m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")
        ]
        text = tar.extractfile(member).read().decode()
    return email.parser.Parser().parsestr(text)


def test_sdist_holds_every_source_and_no_build_output(sdist):
    with tarfile.open(sdist) as tar:
        names = [m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name]
    missing = sorted(set(_util.expected_sdist_members()) - set(names))
    assert not missing, f"not in the sdist: {missing}"
    # nccl_comm.cpp ships even when the sdist is made next to a CPU torch.
    assert "csrc/nccl_comm.cpp" in names and "csrc/grpc_server/grpc_server.cpp" in names
    unwanted = [
        n
        for n in names
        if n.endswith((".so", ".o", ".pyc"))
        or "__pycache__" in n
        or n.startswith(("tests/", "build/", ".venv/"))
    ]
    assert not unwanted, unwanted


def test_sdist_metadata_declares_the_range_and_says_wheels_narrow_it(sdist):
    info = _pkg_info(sdist)
    assert info["Name"] == "ft-torch"
    assert info["License-Expression"] == "BSD-3-Clause"
    requires = info.get_all("Requires-Dist")
    torch_req = [r for r in requires if r.startswith("torch")]
    assert torch_req and "==" not in torch_req[0] and "<" in torch_req[0], torch_req
    # PEP 643: a wheel built from this sdist may differ here (it pins torch's major.minor).
    assert "requires-dist" in [d.lower() for d in info.get_all("Dynamic", [])]


def test_sdist_builds_installs_and_runs_outside_the_tree(sdist, tmp_path):
    _util.skip_unless_enabled()
    src = _util.unpack(sdist, tmp_path / "src")
    venv = tmp_path / "venv"
    python = _util.overlay_venv(venv)
    has_grpcpp = (
        shutil.which("pkg-config") is not None
        and subprocess.run(["pkg-config", "--exists", "grpc++", "libcrypto"]).returncode == 0
    )
    # A wheel leaves the native gRPC server out unless asked: ask, to compile its source too.
    env = _util.clean_env(**({"FT_WHEEL_NATIVE_GRPC": "1"} if has_grpcpp else {}))
    build = _util.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--no-build-isolation",
            "--no-deps",
            "--no-cache-dir",
            "-v",
            src,
        ],
        cwd=tmp_path,
        env=env,
        timeout=900,
    )
    print(f"sdist build+install: {build.seconds:.0f}s")

    out = _util.smoke_installed(python, venv, tmp_path)
    outside, site = out["outside"], str(_util.venv_site_packages(venv))
    assert out["dashboard_bytes"] > 1000
    if has_grpcpp:
        assert out["native_grpc"], "built with FT_WHEEL_NATIVE_GRPC=1 but not importable"

    for script in ("ft-lighthouse", "ft-launch", "torchft_lighthouse"):
        h = _util.run(
            [venv / "bin" / script, "--help"], cwd=outside, env=_util.clean_env(), timeout=120
        )
        assert "usage:" in h.stdout, (script, h.stdout)
    assert "--min_replicas" in h.stdout
    # Every requirement of every installed distribution is met (torch==X.Y.* by the torch the
    # overlay provides).
    _util.run([python, "-m", "pip", "check"], cwd=outside, env=_util.clean_env(), timeout=120)
    assert not list(Path(site).glob("csrc")) and not list(Path(site).glob("tests"))
    assert not os.path.exists(os.path.join(site, "ft", "coordination", "_grpc_server.cpp"))


def test_sdist_builds_without_torch(tmp_path):
    """Packing the sources needs no torch (and no compiler): with torch impossible to import,
    the PEP 517 hook still makes the same sdist."""
    code = """
import sys
class HideTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"{name} is hidden", name=name)
sys.meta_path.insert(0, HideTorch())
from setuptools import build_meta
print(build_meta.build_sdist(sys.argv[1]))
"""
    r = _util.run(
        [sys.executable, "-c", code, tmp_path], cwd=_util.ROOT, env=_util.clean_env(), timeout=300
    )
    sdist = tmp_path / r.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert "csrc/nccl_comm.cpp" in names and "setup.py" in names
