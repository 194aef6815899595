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


def _nightly_native_module():
    """torchft-nightly 2026.10.26's compiled coordination module (its ManagerServer and
    ManagerClient), from its wheel as scripts/torchft_suite.py fetches it (sha256 pinned);
    loaded alone, without the rest of its package."""
    import glob
    import importlib.util
    import platform
    import types
    import zipfile

    if sys.version_info[:2] != (3, 11) or platform.machine() != "x86_64":
        pytest.skip("the nightly's wheel is built for CPython 3.11 on x86_64")
    spec = importlib.util.spec_from_file_location(
        "torchft_suite", os.path.join(REPO, "scripts", "torchft_suite.py")
    )
    harness = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, harness)
    spec.loader.exec_module(harness)
    release = harness.RELEASES["nightly"]
    try:
        wheel = harness.fetch_sdist(harness.DEFAULT_CACHE, release=release)
    except Exception as e:  # noqa: BLE001
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI reaches the package index, but: {e!r}")
        pytest.skip(f"torchft-nightly could not be fetched: {e!r}")
    dest = harness.DEFAULT_CACHE / "nightly-native"
    if not glob.glob(str(dest / "torchft" / "_torchft*.so")):
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("torchft/_torchft") and name.endswith(".so"):
                    zf.extract(name, dest)
    so = glob.glob(str(dest / "torchft" / "_torchft*.so"))[0]
    pkg = types.ModuleType("torchft")  # its parent package, without importing the real one
    pkg.__path__ = [str(dest / "torchft")]
    saved = sys.modules.get("torchft")
    sys.modules["torchft"] = pkg
    try:
        mspec = importlib.util.spec_from_file_location("torchft._torchft", so)
        mod = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(mod)
    finally:
        if saved is None:
            sys.modules.pop("torchft", None)
        else:
            sys.modules["torchft"] = saved
    return mod


def test_reconfigure_handles_cross_between_ft_and_torchft_nightly():
    """The nightly's client asks ft's ManagerServer and its own, both on ft's lighthouse: each
    rank's handle reaches the other replica through both servers and the lighthouse."""
    import threading
    from datetime import timedelta

    from ft.coordination import LighthouseServer, ManagerServer

    nightly = _nightly_native_module()
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    servers = []
    try:
        kw = dict(
            lighthouse_addr=lh.address(),
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            world_size=1,
            heartbeat_interval=timedelta(milliseconds=100),
            connect_timeout=timedelta(seconds=5),
            quorum_retries=0,
        )
        servers.append(ManagerServer(replica_id="a_ft", store_addr="s0:1", **kw))
        servers.append(nightly.ManagerServer(replica_id="b_nightly", store_addr="s1:1", **kw))
        answers = {}

        def ask(name, addr):
            client = nightly.ManagerClient(addr, timedelta(seconds=5))
            q = client._quorum(
                group_rank=0,
                step=1,
                checkpoint_metadata="",
                shrink_only=False,
                init_sync=False,
                commit_failures=0,
                timeout=timedelta(seconds=20),
                reconfigure_handle=f"handle-{name}",
            )
            answers[name] = (list(q.replica_ids), list(q.reconfigure_handles))

        threads = [
            threading.Thread(target=ask, args=(n, s.address()))
            for n, s in zip(("ft", "nightly"), servers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a quorum did not return within 30 s"
        want = (["a_ft", "b_nightly"], ["handle-ft", "handle-nightly"])
        assert answers == {"ft": want, "nightly": want}
    finally:
        for s in servers:
            s.shutdown()
        lh.shutdown()
