"""``pip install .`` from a source checkout into a brand-new venv, with build isolation, on a
machine without gRPC C++: pip reads pyproject.toml, makes the build environment from
[build-system] requires alone (setuptools, wheel, ninja, pybind11, torch), builds the wheel
there, then installs it with every dependency into the venv, which holds nothing else. Catches
a build step that needs something pyproject.toml does not declare, and a wheel whose
requirements do not resolve.

"Without gRPC C++": pkg-config is pointed at an empty folder (PKG_CONFIG_LIBDIR), as on a
machine without libgrpc++-dev. The build must then end with its WARNING (what is missing, what
it costs), and the installed lighthouse must say at start that it serves with grpcio. It also
keeps this test to one compile of ft._C: the native gRPC server is compiled (once) by the
wheel that test_sdist.py and test_wheel.py share.

The checkout is a copy of the working tree without build outputs (.git, .venv, build/, *.so),
so the test never touches the tree's own build. PIP_CONSTRAINT=constraints.txt applies to the
build environment too (pip < 26.2): it holds torch to the version of the main lane, which on
this project's machines is a local file, instead of the newest (CUDA) torch in range.
"""

from __future__ import annotations

import re
import shutil
import signal

from tests.packaging import _util
from tests.procs import Proc, lighthouse_argv


def test_pip_install_dot_in_a_fresh_venv_with_build_isolation(tmp_path):
    _util.skip_unless_enabled()
    src = tmp_path / "checkout"
    shutil.copytree(_util.ROOT, src, ignore=_util.IGNORE_BUILD_OUTPUTS, symlinks=True)
    venv = tmp_path / "venv"
    python = _util.pip_venv(venv)
    no_pc_files = tmp_path / "no-pc-files"
    no_pc_files.mkdir()
    env = _util.clean_env(
        PIP_CONSTRAINT=str(_util.ROOT / "constraints.txt"),
        PKG_CONFIG_LIBDIR=str(no_pc_files),
        PKG_CONFIG_PATH="",
    )
    for name in ("FT_NATIVE_GRPC", "FT_WHEEL_NATIVE_GRPC"):
        env.pop(name, None)
    # -v: pip shows the build's own output only when verbose (or when the build fails).
    r = _util.run([python, "-m", "pip", "install", "-v", "."], cwd=src, env=env, timeout=1200)
    print(f"pip install . (isolated build + dependencies): {r.seconds:.0f}s")

    # The build's WARNING comes after the compiler's output: the build log ends with it.
    log = [line.strip() for line in (r.stdout + r.stderr).splitlines()]  # pip indents it
    warned = [i for i, line in enumerate(log) if line.startswith("WARNING: ft is built without")]
    compiled = [
        i for i, line in enumerate(log) if re.search(r"(?:^|[\s/-])[cg]\+\+\s.*\s-o\s", line)
    ]
    assert warned and compiled, "\n".join(log[-80:])
    assert warned[-1] > compiled[-1], "the WARNING must follow the compiler's output"
    assert "gRPC C++ (pkg-config grpc++)" in log[warned[-1]] and "grpcio" in log[warned[-1]]

    out = _util.smoke_installed(python, venv, tmp_path)
    outside = out["outside"]
    assert not out["native_grpc"], "built where pkg-config finds no gRPC C++"
    h = _util.run(
        [venv / "bin" / "ft-lighthouse", "--help"], cwd=outside, env=_util.clean_env(), timeout=120
    )
    assert "--min_replicas" in h.stdout
    _util.run([python, "-m", "pip", "check"], cwd=outside, env=_util.clean_env(), timeout=120)

    # The lighthouse of this install says, once, that it serves with grpcio.
    with Proc(
        lighthouse_argv(venv / "bin" / "ft-lighthouse"),
        cwd=outside,
        env=_util.clean_env(),
        source_tree=False,
        name="ft-lighthouse (pip install .)",
    ) as proc:
        proc.wait_for_line(r"^ft-lighthouse ready", 60)
        proc.signal(signal.SIGTERM)
        assert proc.wait(15) == 0, proc.output()
    serving = [line for line in proc.lines if "lighthouse serving gRPC" in line]
    assert len(serving) == 1 and "(grpcio server)" in serving[0], proc.output()
