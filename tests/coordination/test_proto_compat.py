"""ft's coordination runs on the oldest grpcio and protobuf that pyproject.toml admits.

tools/gen_proto.py removes the generated stubs' refusal of any grpcio/protobuf older than the
generator (grpcio-tools 1.85 would refuse the grpcio 1.84 on our own GPU image). This checks
the floors it promises instead: a child process imports ft with the floor versions first on
sys.path and runs a real lighthouse, manager server and their clients over loopback.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.procs import REPO, python_argv

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

# Exactly the floors in pyproject.toml.
FLOORS = {"grpcio": "1.64.0", "protobuf": "4.25.0"}


def _dependencies():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def test_floors_match_pyproject():
    reqs = _dependencies()
    for name, version in FLOORS.items():
        assert any(r.startswith(f"{name}>={version}") for r in reqs), (name, reqs)


@pytest.fixture(scope="module")
def floor_site(tmp_path_factory):
    target = tmp_path_factory.mktemp("floor_site")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--target",
        str(target),
    ] + [f"{n}=={v}" for n, v in FLOORS.items()]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("pip did not install the floor versions within 300 s")
    if r.returncode != 0:
        msg = f"pip could not install {FLOORS}: {r.stderr.strip()[-500:]}"
        if os.environ.get("CI", "").lower() == "true":
            # CI reaches the package index: the floors are a promise it must check, not skip.
            pytest.fail(msg)
        # No package index (e.g. the GPU machine), or no wheel of these old releases for this
        # Python: nothing to run.
        pytest.skip(msg)
    return str(target)


def test_coordination_round_trip_on_the_oldest_grpcio_and_protobuf(floor_site):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([floor_site, env.get("PYTHONPATH", "")])
    # -m in the repository root: ft and tests come from it; it holds no grpc or protobuf, so the
    # floor versions are the first found.
    r = subprocess.run(
        python_argv("tests.coordination.proto_compat_child", FLOORS["grpcio"], FLOORS["protobuf"]),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"grpcio": FLOORS["grpcio"], "protobuf": FLOORS["protobuf"], "ok": True}
