"""ft-lighthouse: flags in both spellings, --help, logging of quorum changes, clean shutdown;
start_lighthouse_process, the launcher scripts and benchmarks use."""

import os
import signal

import pytest

from ft.coordination import LighthouseClient
from ft.coordination.cli import build_parser, main, start_lighthouse_process
from tests.coordination._helpers import wait_for


def test_help_lists_both_spellings(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--min_replicas",
        "--min-replicas",
        "--join_timeout_ms",
        "--join-timeout-ms",
        "--quorum_tick_ms",
        "--quorum-tick-ms",
        "--heartbeat_timeout_ms",
        "--heartbeat-timeout-ms",
        "--bind",
        "--auth_token",
        "--auth-token",
    ):
        assert flag in out


def test_flag_spellings_parse_the_same():
    p = build_parser()
    a = p.parse_args(
        [
            "--min_replicas",
            "3",
            "--join_timeout_ms",
            "10",
            "--quorum_tick_ms",
            "5",
            "--heartbeat_timeout_ms",
            "7",
            "--http_bind",
            "",
        ]
    )
    b = p.parse_args(
        [
            "--min-replicas",
            "3",
            "--join-timeout-ms",
            "10",
            "--quorum-tick-ms",
            "5",
            "--heartbeat-timeout-ms",
            "7",
            "--http-bind",
            "",
        ]
    )
    assert vars(a) == vars(b)
    assert a.min_replicas == 3 and a.join_timeout_ms == 10 and a.bind is None and not a.insecure


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serves_logs_and_shuts_down_cleanly(children, sig):
    child = children(
        "cli",
        "--bind",
        "127.0.0.1:0",
        "--min-replicas",
        "1",
        "--quorum-tick-ms",
        "20",
        "--heartbeat-timeout-ms",
        "500",
        "--join_timeout_ms",
        "100",
    )
    line = child.ready_line()
    grpc_addr = line.split("grpc=")[1].split()[0]
    assert "dashboard=http://127.0.0.1:" in line
    q = LighthouseClient(grpc_addr, 5.0).quorum("cli-replica", 5.0)
    assert [p.replica_id for p in q.participants] == ["cli-replica"]
    wait_for(
        lambda: f"quorum {q.quorum_id}: first quorum" in child.output(), what="quorum change logged"
    )
    child.proc.send_signal(sig)
    assert child.wait(10) == 0
    assert "shutting down" in child.output()


def test_lighthouse_runs_and_forms_a_quorum_without_torch(children):
    """A lighthouse host needs grpcio and protobuf only: with torch and ft._C impossible to
    import, ft-lighthouse starts, forms a quorum and shuts down cleanly."""
    child = children(
        "cli-without-torch",
        "--bind",
        "127.0.0.1:0",
        "--min-replicas",
        "2",
        "--quorum-tick-ms",
        "20",
        "--join_timeout_ms",
        "100",
        "--http_bind",
        "",
    )
    grpc_addr = child.ready_line().split("grpc=")[1].split()[0]
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(2) as pool:
        quorums = list(
            pool.map(lambda r: LighthouseClient(grpc_addr, 5.0).quorum(r, 10.0), ["a", "b"])
        )
    assert all(sorted(p.replica_id for p in q.participants) == ["a", "b"] for q in quorums)
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait(10) == 0, child.output()
    assert "is hidden" not in child.output()


@pytest.mark.parametrize("new_session", [False, True])
def test_start_lighthouse_process_serves_then_stops_and_reaps(new_session):
    with start_lighthouse_process(
        1, quorum_tick_ms=20, join_timeout_ms=100, log_level="INFO", new_session=new_session
    ) as lh:
        assert (os.getpgid(lh.pid) == lh.pid) is new_session
        q = LighthouseClient(lh.address, 5.0).quorum("launched", 5.0)
        assert [p.replica_id for p in q.participants] == ["launched"]
        assert lh.log_path is None  # an unnamed file: nothing to clean up, however this ends
    assert lh.proc.returncode == 0  # SIGTERM: a clean shutdown, and reaped
    assert "shutting down" in lh.output()  # still readable once stopped
    assert lh.stop() == 0  # again: nothing more to do


def test_start_lighthouse_process_fails_with_output_and_reaps(tmp_path):
    log = tmp_path / "lh.log"
    with pytest.raises(RuntimeError, match=r"(?s)exited \(2\).*no_such_flag") as e:
        start_lighthouse_process(1, no_such_flag=1, log_path=log)
    assert "did not start" in str(e.value)
    assert "no_such_flag" in log.read_text()  # a log the caller named is kept


def test_start_lighthouse_process_bounds_the_wait(tmp_path, monkeypatch):
    """A child that never prints the ready line is stopped and reaped at the deadline."""
    import subprocess

    started = []
    real = subprocess.Popen

    def popen(argv, **kw):
        p = real([argv[0], "-c", "import time; time.sleep(60)"], **kw)
        started.append(p)
        return p

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(RuntimeError, match=r"not ready in 0.5s"):
        start_lighthouse_process(1, ready_timeout=0.5, log_path=tmp_path / "lh.log")
    assert started[0].returncode == -signal.SIGTERM
