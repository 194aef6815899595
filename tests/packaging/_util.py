"""Helpers of the packaging tests: build the sdist, make throwaway environments, run commands
in them from outside the source tree.

The slow tests here compile ft from an sdist (minutes on 2 cores). They run where CI=true (as
in `.ci/run`) or FT_TEST_PACKAGING=1, and skip elsewhere so that a developer's
`scripts/test.sh` stays quick.
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
HERE = Path(__file__).resolve().parent
# shutil.copytree's ignore for a copy of the checkout without build outputs.
IGNORE_BUILD_OUTPUTS = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.so",
    "*.o",
    "__pycache__",
    "*.egg-info",
    ".hypothesis",
    ".pytest_cache",
)


def slow_tests_enabled() -> bool:
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("FT_TEST_PACKAGING") == "1"


def skip_unless_enabled() -> None:
    if not slow_tests_enabled():
        pytest.skip(
            "builds ft from an sdist (minutes): runs in CI (CI=true) or with FT_TEST_PACKAGING=1"
        )


def clean_env(**extra: str) -> Dict[str, str]:
    """This process's environment without what would let a child find the source tree."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
    }
    env.setdefault("MAX_JOBS", "2")
    env.update(extra)
    return env


def run(
    cmd: Sequence[str],
    *,
    timeout: float,
    cwd: Optional[Path] = None,
    env: Optional[Dict[str, str]] = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    start = time.monotonic()
    r = subprocess.run(
        [str(c) for c in cmd],
        cwd=str(cwd) if cwd else None,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    r.seconds = time.monotonic() - start  # type: ignore[attr-defined]
    if check and r.returncode != 0:
        raise AssertionError(
            f"exit {r.returncode} after {r.seconds:.0f}s: {shlex.join(map(str, cmd))}\n"
            f"--- stdout (tail)\n{r.stdout[-4000:]}\n--- stderr (tail)\n{r.stderr[-6000:]}"
        )
    return r


def build_sdist(out_dir: Path) -> Path:
    """The sdist, built from the working tree by the PEP 517 hook that pip and `build` call."""
    code = (
        "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    )
    r = run([sys.executable, "-c", code, out_dir], cwd=ROOT, env=clean_env(), timeout=300)
    name = r.stdout.strip().splitlines()[-1]
    return out_dir / name


def unpack(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    (top,) = [p for p in into.iterdir() if p.is_dir()]
    return top


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def venv_site_packages(venv: Path) -> Path:
    (site,) = glob.glob(str(venv / "lib" / "python3*" / "site-packages"))
    return Path(site)


def overlay_venv(venv: Path) -> Path:
    """A new, empty venv that also sees this interpreter's site-packages (torch, grpcio,
    setuptools, ninja, pybind11, pip), appended after its own through a .pth file, so that
    nothing is downloaded or unpacked again. Whatever is installed into it goes to its own
    site-packages and comes first on sys.path. Returns its interpreter."""
    run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=120)
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (venv_site_packages(venv) / "_ft_test_overlay.pth").write_text("\n".join(paths) + "\n")
    return venv_python(venv)


def pip_venv(venv: Path) -> Path:
    """A new venv with only pip (and what python -m venv puts there)."""
    run([sys.executable, "-m", "venv", venv], timeout=180)
    return venv_python(venv)


def expected_sdist_members() -> List[str]:
    """Paths (relative to the sdist's top folder) that the sdist must hold."""
    patterns = [
        "csrc/*.cpp",
        "csrc/*.hpp",
        "csrc/**/*.cpp",
        "csrc/**/*.hpp",
        "proto/*.proto",
        "tools/*.py",
        "ft/**/*.py",
        "ft/coordination/dashboard/*.html",
        "ft/coordination/_proto/*.pyi",
    ]
    found = set()
    for pattern in patterns:
        for path in glob.glob(str(ROOT / pattern), recursive=True):
            rel = os.path.relpath(path, ROOT)
            if "__pycache__" not in rel:
                found.add(rel)
    found |= {
        "CMakeLists.txt",
        "LICENSE",
        "README.md",
        "pyproject.toml",
        "setup.py",
        "MANIFEST.in",
        "constraints.txt",
        "examples/deploy/Dockerfile.lighthouse",
        "PKG-INFO",
    }
    return sorted(found)


def smoke_installed(python: Path, venv: Path, tmp_path: Path) -> Dict[str, Any]:
    """Runs smoke_installed.py with ``python`` from a folder outside the tree (so that only the
    installed package can be imported); checks that ft and its extension came from ``venv``,
    that a 2-process allreduce on the "ft" backend gave the sum, and that the distribution
    pins the torch it was built against. Returns the script's report for further checks."""
    import json
    import shutil

    outside = tmp_path / "elsewhere"
    outside.mkdir(exist_ok=True)
    smoke = shutil.copy(HERE / "smoke_installed.py", outside / "smoke_installed.py")
    r = run([python, smoke], cwd=outside, env=clean_env(), timeout=300)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    site = str(venv_site_packages(venv))
    assert out["ft_file"].startswith(site) and out["c_file"].startswith(site), out
    assert out["allreduce"] == [[3.0] * 8, [3.0] * 8], out
    major_minor = ".".join(out["torch"].split("+")[0].split(".")[:2])
    assert f"torch=={major_minor}.*" in out["requires"], out["requires"]
    out["outside"] = outside
    return out
