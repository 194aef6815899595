"""What a torchft user's tooling sees from ft.Manager: torchft's record loggers
(torchft_quorums / torchft_commits / torchft_errors, with torchft's extra fields), the
torch.profiler spans under torchft's names, and the job-wide ranks given to configure().
Real lighthouse, ManagerServers and ft process groups, one Manager per thread."""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import ft
from tests.manager.inproc import in_threads, lighthouse, make_manager, values


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records():
    handler = _Records()
    loggers = [
        logging.getLogger(n) for n in ("torchft_quorums", "torchft_commits", "torchft_errors")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    yield handler.records
    for lg, level in zip(loggers, levels):
        lg.removeHandler(handler)
        lg.setLevel(level)


def _fields(r: logging.LogRecord, *names: str) -> Dict[str, Any]:
    return {n: getattr(r, n) for n in names}


def test_records_spans_and_global_ranks(records, monkeypatch) -> None:
    monkeypatch.setenv("JOB_ID", "job-42")
    lh = lighthouse(min_replicas=2)
    ms = [make_manager(lh.address(), f"g{i}", use_async_quorum=False) for i in range(2)]
    try:

        def step(m: ft.Manager) -> bool:
            m.start_quorum()
            m.allreduce(torch.ones(3)).wait()
            return m.should_commit()

        # The profiler records the thread that runs it: g0 steps here, g1 on a thread.
        other = threading.Thread(target=lambda: out.append(step(ms[1])), daemon=True)
        out: List[bool] = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            other.start()
            out.append(step(ms[0]))
            other.join(30)
        assert out == [True, True]
        # A second step in the same quorum: a commit record, no new quorum record.
        assert values(in_threads([lambda m=m: step(m) for m in ms])) == [True, True]

        quorums = [r for r in records if r.name == "torchft_quorums"]
        commits = [r for r in records if r.name == "torchft_commits"]
        assert sorted(r.replica_id.split(":")[0] for r in quorums) == ["g0", "g1"]
        for r in quorums:
            assert r.getMessage() == ""
            assert _fields(r, "job_id", "rank", "step") == {
                "job_id": "job-42",
                "rank": 0,
                "step": 0,
            }
            assert r.quorum_id == ms[0].quorum_id()
        assert len(commits) == 4
        assert {(r.replica_id.split(":")[0], r.step, r.commit_result) for r in commits} == {
            ("g0", 0, True),
            ("g1", 0, True),
            ("g0", 1, True),
            ("g1", 1, True),
        }
        assert all(r.job_id == "job-42" and r.rank == 0 for r in commits)

        # configure() got each group's peers as job-wide ranks (group world size 1: 0 and 1).
        for m in ms:
            assert m._pg.global_ranks == [0, 1]

        # An abort after an error is a torchft_errors record.
        ms[0]._pg.abort()
        errors = [r for r in records if r.name == "torchft_errors"]
        assert [(r.error, r.job_id) for r in errors] == [("process_group_abort", "job-42")]
        ms[0]._pg.abort(errored=False)  # a planned abort is not an error
        assert len([r for r in records if r.name == "torchft_errors"]) == 1
    finally:
        in_threads([lambda m=m: m.shutdown() for m in ms])
        lh.shutdown()
    # The profiler saw the Manager's spans under torchft's names (the quorum's own spans run on
    # the Manager's quorum thread).
    names = {e.name for e in prof.events()}
    assert {
        "torchft::manager::allreduce",
        "torchft::manager::should_commit",
        "torchft::manager::wait_quorum",
    } <= names, names


def test_a_torchft_style_process_group_gets_only_the_four_arguments() -> None:
    """A process group written against torchft's base class (configure with four
    parameters) works under ft.Manager: the Manager passes ft's extra facts only to a
    configure() that names them."""
    calls: List[tuple] = []

    class FourArgs(ft.ProcessGroupGloo):
        def configure(self, store_addr, replica_id, rank, world_size):  # torchft's signature
            calls.append((rank, world_size))
            super().configure(store_addr, replica_id, rank, world_size)

    lh = lighthouse(min_replicas=1)
    m = make_manager(lh.address(), "g0", use_async_quorum=False)
    m._pg = FourArgs()
    from ft.manager_parts.group_rebuild import keyword_parameters as _keyword_parameters

    m._pg_configure_takes = _keyword_parameters(m._pg.configure)
    try:
        m.start_quorum()
        m.allreduce(torch.ones(1)).wait()
        assert m.should_commit()
        assert calls == [(0, 1)]
    finally:
        m.shutdown()
        lh.shutdown()
