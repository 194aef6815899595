"""``pip install .`` from a source checkout into a brand-new venv, with build isolation: pip
reads pyproject.toml, makes the build environment from [build-system] requires alone
(setuptools, wheel, ninja, pybind11, torch), builds the wheel there, then installs it with
every dependency into the venv, which holds nothing else. Catches a build step that needs
something pyproject.toml does not declare, and a wheel whose requirements do not resolve.

The checkout is a copy of the working tree without build outputs (.git, .venv, build/, *.so),
so the test never touches the tree's own build. PIP_CONSTRAINT=constraints.txt applies to the
build environment too (pip < 26.2): it holds torch to the version of the main lane, which on
this project's machines is a local file, instead of the newest (CUDA) torch in range.
Compiles ft._C once (the wheel leaves the native gRPC server out by default).
"""

from __future__ import annotations

import shutil

from tests.packaging import _util

IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "*.so",
    "*.o",
    "__pycache__",
    "*.egg-info",
    ".hypothesis",
    ".pytest_cache",
)


def test_pip_install_dot_in_a_fresh_venv_with_build_isolation(tmp_path):
    _util.skip_unless_enabled()
    src = tmp_path / "checkout"
    shutil.copytree(_util.ROOT, src, ignore=IGNORE, symlinks=True)
    venv = tmp_path / "venv"
    python = _util.pip_venv(venv)
    env = _util.clean_env(PIP_CONSTRAINT=str(_util.ROOT / "constraints.txt"))
    r = _util.run([python, "-m", "pip", "install", "."], cwd=src, env=env, timeout=1200)
    print(f"pip install . (isolated build + dependencies): {r.seconds:.0f}s")

    out = _util.smoke_installed(python, venv, tmp_path)
    outside = out["outside"]
    assert not out["native_grpc"], "a wheel includes the native gRPC server only on request"
    h = _util.run(
        [venv / "bin" / "ft-lighthouse", "--help"], cwd=outside, env=_util.clean_env(), timeout=120
    )
    assert "--min_replicas" in h.stdout
    _util.run([python, "-m", "pip", "check"], cwd=outside, env=_util.clean_env(), timeout=120)
