"""The sdist holds everything a build needs, is made by the README's command in a fresh venv
without torch, and builds, installs and runs from outside the source tree.

How (the fastest honest way on a 2-core machine):
1. The sdist is built from the working tree by setuptools' PEP 517 hook ``build_sdist`` (what
   ``pip`` and ``python -m build`` call; conftest.py's ``sdist``).
2. ``bash scripts/build_wheel.sh <sdist>`` (conftest.py's ``built_wheel``, shared with
   test_wheel.py and test_lighthouse_image.py: the packaging tests' one compile of ft with the
   native gRPC server) unpacks it, builds the wheel from the sdist's sources only (ft._C, and
   the native gRPC server where gRPC C++ is installed), repairs it with auditwheel and installs
   it with its dependencies into a fresh venv.
3. From a temporary folder, with no PYTHONPATH: ``import ft`` must come from that venv, two
   processes allreduce on the "ft" backend, ``ft-lighthouse --help`` and ``ft-launch --help``
   run, and the installed metadata pins torch to the built-against major.minor.

Build time (2 cores, MAX_JOBS=2): docs/building.md, "Tests"; the build fails past 25 minutes.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

from tests.packaging import _util

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


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


def test_sdist_builds_installs_and_runs_outside_the_tree(built_wheel, tmp_path):
    venv = built_wheel.check_venv
    python = _util.venv_python(venv)
    out = _util.smoke_installed(python, venv, tmp_path)
    outside, site = out["outside"], str(_util.venv_site_packages(venv))
    assert out["dashboard_bytes"] > 1000
    assert out["native_grpc"] == built_wheel.native

    for script in ("ft-lighthouse", "ft-launch", "torchft_lighthouse"):
        h = _util.run(
            [venv / "bin" / script, "--help"], cwd=outside, env=_util.clean_env(), timeout=120
        )
        assert "usage:" in h.stdout, (script, h.stdout)
    assert "--min_replicas" in h.stdout
    # Every requirement of every installed distribution is met (torch==X.Y.* too).
    _util.run([python, "-m", "pip", "check"], cwd=outside, env=_util.clean_env(), timeout=120)
    assert not list(Path(site).glob("csrc")) and not list(Path(site).glob("tests"))
    assert not os.path.exists(os.path.join(site, "ft", "coordination", "_grpc_server.cpp"))


def readme_sdist_commands():
    """The commands of README.md's "From an sdist" block, verbatim."""
    lines = (_util.ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("From an sdist"))
    block = []
    for line in lines[start + 1 :]:
        if line.startswith("    "):
            block.append(line.strip())
        elif block:
            break
    return block


def test_the_readme_sdist_command_works_in_a_fresh_venv(tmp_path):
    """README.md's commands for making the sdist, run as written in a fresh venv that has
    neither torch nor any other build requirement beyond what they install."""
    _util.skip_unless_enabled()  # installs from the package index
    commands = readme_sdist_commands()
    assert any(c.startswith("python -m build --sdist") for c in commands), commands
    venv = tmp_path / "venv"
    python = _util.pip_venv(venv)
    src = tmp_path / "checkout"
    shutil.copytree(_util.ROOT, src, ignore=_util.IGNORE_BUILD_OUTPUTS, symlinks=True)
    env = _util.clean_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for command in commands:
        r = _util.run(["bash", "-c", command], cwd=src, env=env, timeout=600)
        print(f"{command}: {r.seconds:.0f}s")
    r = _util.run([python, "-c", "import torch"], cwd=tmp_path, env=env, timeout=60, check=False)
    assert "No module named 'torch'" in r.stderr, "the venv was to pack without torch"
    from ft._version import __version__

    (made,) = (src / "dist").glob("*")
    assert made.name == f"ft_torch-{__version__}.tar.gz", made
    with tarfile.open(made) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    missing = sorted(set(_util.expected_sdist_members()) - names)
    assert not missing, f"not in the sdist: {missing}"


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
