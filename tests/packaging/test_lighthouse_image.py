"""examples/deploy/Dockerfile.lighthouse builds a lighthouse that needs neither torch nor a
compiler, and serves on the native gRPC server (from the wheel scripts/build_wheel.sh makes).

There is no container runtime on these machines, so the test replays the Dockerfile's own
steps in a fresh venv (same Python minor as its base image where possible): COPY copies the
listed paths of the build context into a scratch folder standing for the image's WORKDIR
(the context is the repository, except that ``build/wheelhouse/`` is the folder of the wheel
build_wheel.sh made from the sdist: conftest.py's ``built_wheel``), and each RUN step, which
must be a chain of ``pip install`` commands (checked before anything runs), runs there with the
venv's pip first on PATH. Then, in that venv: torch cannot be imported, nothing was compiled
(the only extensions are the wheel's), ``python -m ft.coordination.cli --help`` and the
ENTRYPOINT with ``--help`` work, and a lighthouse started the same way (on loopback) says it
serves on the native server, answers a quorum and shuts down cleanly.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import zipfile
from pathlib import Path
from typing import List, Tuple

from tests.packaging import _util
from tests.procs import Proc, lighthouse_argv

DOCKERFILE = _util.ROOT / "examples" / "deploy" / "Dockerfile.lighthouse"
# One `pip install` command; no absolute path, redirection, substitution or other command.
PIP_STEP = re.compile(r"^(?:FT_BUILD_EXTENSIONS=0 )?pip install(?: (?!/)[-\w.=,:/*]+)+$")
WHEELHOUSE = "build/wheelhouse/"


def instructions() -> List[Tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, arg = line.partition(" ")
            out.append((op.upper(), " ".join(arg.split())))
    return out


def test_dockerfile_is_slim_and_runs_the_lighthouse():
    ins = dict(instructions())
    assert re.fullmatch(r"python:3\.\d+-slim", ins["FROM"]), ins["FROM"]
    entry = json.loads(ins["ENTRYPOINT"])
    assert entry[0] == "ft-lighthouse"
    assert not re.search(r"\btorch\b", ins["RUN"]) and "apt-get" not in ins["RUN"]
    assert os.path.isabs(ins["ENV"].split("=", 1)[1])  # FT_JOB_SECRET_FILE: a path only
    for op, arg in instructions():
        if op in ("COPY", "ADD"):
            assert "secret" not in arg.lower()


def context_paths(src: str, wheelhouse: Path) -> List[Path]:
    """The files and folders a COPY source names in the build context (wildcards expanded)."""
    if src.startswith(WHEELHOUSE):
        base, pattern = wheelhouse, src[len(WHEELHOUSE) :]
    else:
        base, pattern = _util.ROOT, src
    found = sorted(base.glob(pattern))
    assert found, f"COPY {src}: nothing in the build context"
    return found


def test_the_image_steps_give_a_lighthouse_without_torch(built_wheel, tmp_path):
    venv = tmp_path / "venv"
    python = _util.pip_venv(venv)
    env = _util.clean_env(
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", PIP_DISABLE_PIP_VERSION_CHECK="1"
    )
    workdir = tmp_path / "rootfs"
    for op, arg in instructions():
        if op == "WORKDIR":
            workdir = tmp_path / "rootfs" / arg.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif op == "COPY":
            *srcs, dst = shlex.split(arg)
            for path in [p for src in srcs for p in context_paths(src, built_wheel.wheel.parent)]:
                target = workdir / dst / (path.name if dst.endswith("/") else "")
                if path.is_dir():
                    shutil.copytree(
                        path,
                        workdir / dst,
                        dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"),
                    )
                else:
                    shutil.copy(path, target)
        elif op == "RUN":
            steps = [s.strip() for s in arg.split("&&")]
            bad = [s for s in steps if not PIP_STEP.match(s)]
            assert not bad, f"the test replays only `pip install` steps: {bad}"
            for step in steps:
                r = _util.run(["bash", "-c", step], cwd=workdir, env=env, timeout=600)
                print(f"{step}: {r.seconds:.0f}s")
                assert "Building wheel" not in r.stdout, r.stdout  # nothing is compiled
        else:
            assert op in ("FROM", "ENV", "EXPOSE", "ENTRYPOINT", "CMD"), op

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    r = _util.run([python, "-c", "import torch"], cwd=outside, env=env, timeout=60, check=False)
    assert r.returncode != 0 and "No module named 'torch'" in r.stderr
    r = _util.run([python, "-m", "pip", "list", "--format=json"], cwd=outside, env=env, timeout=60)
    installed = {p["name"].lower() for p in json.loads(r.stdout)}
    assert {"ft-torch", "grpcio", "protobuf"} <= installed
    assert not installed & {"torch", "numpy"}, installed
    site = _util.venv_site_packages(venv)
    with zipfile.ZipFile(built_wheel.wheel) as whl:
        from_wheel = {n for n in whl.namelist() if n.endswith(".so") and n.startswith("ft/")}
    assert {str(p.relative_to(site)) for p in (site / "ft").rglob("*.so")} == from_wheel

    h = _util.run([python, "-m", "ft.coordination.cli", "--help"], cwd=outside, env=env, timeout=60)
    assert "--min_replicas" in h.stdout
    entry = json.loads(dict(instructions())["ENTRYPOINT"])
    h = _util.run([venv / "bin" / entry[0], *entry[1:], "--help"], cwd=outside, env=env, timeout=60)
    assert "--min_replicas" in h.stdout

    # The entrypoint serving for real, on loopback instead of 0.0.0.0 (the venv's ft only: no
    # source tree on its PYTHONPATH).
    with Proc(
        lighthouse_argv(venv / "bin" / entry[0], join_timeout_ms=100),
        cwd=outside,
        env=env,
        source_tree=False,
        name="ft-lighthouse (image)",
    ) as proc:
        line = proc.wait_for_line(r"^ft-lighthouse ready", 60)
        seen = proc.lines[: proc.lines.index(line) + 1]
        assert line.startswith("ft-lighthouse ready grpc=http://127.0.0.1:"), "\n".join(seen)
        server = "native" if built_wheel.native else "grpcio"
        assert f"lighthouse serving gRPC ({server} server)" in "\n".join(seen), "\n".join(seen)
        from ft.coordination import LighthouseClient  # the source tree's, in this process

        q = LighthouseClient(line.split("grpc=")[1].split()[0], 5.0).quorum("solo", 10.0)
        assert [p.replica_id for p in q.participants] == ["solo"]
        proc.signal(signal.SIGTERM)
        assert proc.wait(15) == 0, proc.output()
    du = sum(f.stat().st_size for f in site.rglob("*") if f.is_file())
    copied = sum(f.stat().st_size for f in (tmp_path / "rootfs").rglob("*") if f.is_file())
    print(
        f"lighthouse venv site-packages: {du / 2**20:.0f} MiB, "
        f"plus {copied / 2**20:.1f} MiB copied into the image's WORKDIR"
    )
