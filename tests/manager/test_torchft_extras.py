"""The torchft names ft gained besides the process groups: ft.futures, ft.work, the Manager's
ExceptionWithTraceback / get_timeout / set_state_dict_fns, ManagedProcessGroup and
PureDistributedDataParallel on real Managers, extract_local_tensor,
HTTPTransport.allow_checkpoint, ParameterServer and setup_logger."""

from __future__ import annotations

import pickle
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any, List

import pytest
import torch
import torch.distributed as dist

import ft
from ft.checkpointing import CheckpointCorruptError, CheckpointError, HTTPTransport
from ft.ddp import PureDistributedDataParallel
from ft.futures import context_timeout, future_timeout, future_wait, stream_timeout
from ft.local_sgd import extract_local_tensor
from ft.manager import ExceptionWithTraceback, get_timeout
from ft.parameter_server import ParameterServer
from ft.process_group import FakeProcessGroupWrapper, ManagedProcessGroup
from ft.utils.auth import InsecureServerError
from ft.work import _DummyWork
from tests.manager.inproc import (
    on_each,
    TO,
    in_threads,
    lighthouse,
    make_manager,
    replica_managers,
    values,
)

# ------------------------------------------------------------------ ft.futures


def test_future_timeout_fires_within_its_bound() -> None:
    never: torch.futures.Future = torch.futures.Future()
    t0 = time.monotonic()
    timed = future_timeout(never, timedelta(seconds=0.2))
    with pytest.raises(TimeoutError):
        timed.wait()
    elapsed = time.monotonic() - t0
    assert 0.18 <= elapsed < 1.5, elapsed
    never.set_result(1)  # a late completion changes nothing
    with pytest.raises(TimeoutError):
        timed.wait()


def test_future_timeout_passes_on_what_completes_in_time() -> None:
    ok: torch.futures.Future = torch.futures.Future()
    timed = future_timeout(ok, timedelta(seconds=5))
    ok.set_result(7)
    assert timed.wait() == 7
    bad: torch.futures.Future = torch.futures.Future()
    timed = future_timeout(bad, timedelta(seconds=5))
    bad.set_exception(ValueError("nope"))
    with pytest.raises(ValueError, match="nope"):
        timed.wait()


def test_future_wait_returns_or_raises_within_its_bound() -> None:
    done: torch.futures.Future = torch.futures.Future()
    threading.Timer(0.05, lambda: done.set_result("v")).start()
    assert future_wait(done, timedelta(seconds=5)) == "v"
    never: torch.futures.Future = torch.futures.Future()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        future_wait(never, timedelta(seconds=0.2))
    assert time.monotonic() - t0 < 1.5


def test_context_timeout_calls_back_only_when_the_block_overruns() -> None:
    fired = threading.Event()
    t0 = time.monotonic()
    with context_timeout(fired.set, timedelta(seconds=0.1)):
        assert fired.wait(2.0), "callback did not run"
    assert time.monotonic() - t0 >= 0.09
    early = threading.Event()
    with context_timeout(early.set, timedelta(seconds=0.1)):
        pass
    time.sleep(0.3)
    assert not early.is_set()


def test_a_raising_callback_does_not_stop_the_timer() -> None:
    def boom() -> None:
        raise RuntimeError("callback failure")

    fired = threading.Event()
    with context_timeout(boom, timedelta(seconds=0.01)):
        time.sleep(0.1)
    with context_timeout(fired.set, timedelta(seconds=0.01)):
        assert fired.wait(2.0)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the CPU-only behaviour")
def test_stream_timeout_without_an_accelerator_does_nothing() -> None:
    fired = threading.Event()
    stream_timeout(fired.set, timedelta(seconds=0.01))
    time.sleep(0.1)
    assert not fired.is_set()


# ------------------------------------------------------------------ ft.work


def test_dummy_work_is_complete_with_its_result() -> None:
    result = [torch.ones(1)]
    work = _DummyWork(result)
    assert work.wait() and work.is_completed() and work.is_success()
    assert work.get_future().wait() is result


# ------------------------------------------------------------------ ft.manager helpers


def _raised(e: BaseException) -> BaseException:
    try:
        raise e
    except BaseException as caught:  # noqa: BLE001
        return caught


def test_exception_with_traceback_keeps_type_message_and_trace() -> None:
    original = _raised(TimeoutError("slow peer"))
    e = ExceptionWithTraceback(original)
    assert isinstance(e, ExceptionWithTraceback) and isinstance(e, TimeoutError)
    assert e.original_exception is original
    assert "_raised" in e.stack_trace and "TimeoutError: slow peer" in e.stack_trace
    assert str(e).startswith("slow peer\n")
    back = pickle.loads(pickle.dumps(e))
    assert isinstance(back, TimeoutError) and str(back) == str(e)
    # attributes of the original stay readable
    http = ExceptionWithTraceback(urllib.error.HTTPError("u", 503, "busy", None, None))  # type: ignore[arg-type]
    assert http.code == 503 and "busy" in str(http)
    # what ft's tests log for an error: the original type's name is in it
    corrupt = ExceptionWithTraceback(CheckpointCorruptError("bad crc"))
    assert "CheckpointCorruptError" in f"{type(corrupt).__name__}: {corrupt}"


def test_get_timeout() -> None:
    default = timedelta(seconds=7)
    assert get_timeout(None, default) == default
    assert get_timeout("", default) == default
    assert get_timeout("3", default) == timedelta(seconds=3)
    assert get_timeout("1.5", default) == timedelta(seconds=1.5)
    with pytest.raises(ValueError, match="'soon'"):
        get_timeout("soon", default)


# ------------------------------------------------------------------ real Managers


def test_managed_group_pure_ddp_and_errored_on_two_replicas() -> None:
    lh = lighthouse(min_replicas=2)
    ms = replica_managers(lh.address(), 2, use_async_quorum=False)
    try:
        with pytest.warns(DeprecationWarning, match="register_state_dict_fn"):
            ms[0].set_state_dict_fns(lambda sd: None, lambda: {"w": 1})
        assert ms[0]._manager_state_dict()["user"]["set_state_dict_fns"] == {"w": 1}

        def step(i: int, m: ft.Manager, fail: bool) -> Any:
            torch.manual_seed(0)
            model = torch.nn.Linear(2, 1, bias=False)
            with torch.no_grad():
                model.weight.fill_(1.0)
            ddp = PureDistributedDataParallel(m, model)
            managed = ManagedProcessGroup(m)
            m.start_quorum()
            ddp(torch.full((1, 2), float(i + 1))).sum().backward()
            grad = model.weight.grad.clone()  # final when backward returns
            t = torch.full((2,), float(i + 1))
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.AVG
            managed.allreduce([t], opts).wait()
            if fail and i == 1:
                m.report_error(_raised(TimeoutError("injected")))
            return grad.tolist(), t.tolist(), managed.size(), m.should_commit()

        out = on_each(ms, step, False)
        assert [o[0] for o in out] == [[[1.5, 1.5]]] * 2
        assert [o[1] for o in out] == [[1.5, 1.5]] * 2
        assert [o[2] for o in out] == [2, 2]
        assert [o[3] for o in out] == [True, True]

        out = on_each(ms, step, True)
        assert [o[3] for o in out] == [True, False]
        err = ms[1].errored()
        assert isinstance(err, ExceptionWithTraceback) and isinstance(err, TimeoutError)
        assert str(err.original_exception) == "injected" and "injected" in err.stack_trace
    finally:
        in_threads([lambda m=m: m.shutdown() for m in ms])
        lh.shutdown()


def test_manager_over_a_fake_wrapper_skips_the_injected_step() -> None:
    # torchft's integration tests inject allreduce failures this way.
    lh = lighthouse(min_replicas=2)
    fake = FakeProcessGroupWrapper(ft.ProcessGroupGloo(timeout=TO))

    def start(i: int) -> ft.Manager:
        if i == 0:
            return make_manager(lh.address(), "g0", use_async_quorum=False)
        return make_manager(lh.address(), "g1", pg=fake, use_async_quorum=False)

    ms: List[ft.Manager] = values(in_threads([lambda i=i: start(i) for i in range(2)]))
    try:

        def step(i: int, m: ft.Manager, inject: bool) -> Any:
            m.start_quorum()
            if inject and i == 1:
                fake.report_future_error(RuntimeError("injected allreduce error"))
            t = torch.full((2,), float(i + 1))
            m.allreduce(t).wait()
            return t.tolist(), m.should_commit()

        out = on_each(ms, step, True)
        # the data moved; only the replica whose Work failed votes against its step
        assert out[0][0] == [1.5, 1.5] and [o[1] for o in out] == [True, False]
        assert isinstance(ms[1].errored(), RuntimeError)
        assert "injected allreduce error" in str(ms[1].errored())
        out = on_each(ms, step, False)
        assert [o[1] for o in out] == [True, True]
    finally:
        in_threads([lambda m=m: m.shutdown() for m in ms])
        lh.shutdown()


def test_torchfts_participation_fields_read_and_set_the_managers() -> None:
    """torchft's tests set Manager._participating_replica_rank / _world_size: ft keeps both in
    its one Participation, and the public methods and the allreduce divisor follow them."""
    lh = lighthouse(min_replicas=1)
    m = make_manager(lh.address(), "g0", use_async_quorum=False)
    try:
        m.start_quorum()
        assert (m._participating_replica_rank, m._participating_replica_world_size) == (0, 1)
        m._participating_replica_rank = 1
        m._participating_replica_world_size = 5
        assert m.participating_rank() == 1 and m.num_participants() == 5
        assert m.is_participating()
        t = torch.tensor([10.0])
        m.allreduce(t).wait()  # one replica's sum, divided by the 5 set above
        assert t.item() == 2.0
        m._participating_replica_rank = None
        assert not m.is_participating()
    finally:
        m.shutdown()
        lh.shutdown()


# ------------------------------------------------------------------ extract_local_tensor


def test_extract_local_tensor_copies_without_grad() -> None:
    t = torch.arange(3.0)
    t.grad = torch.ones(3)
    copy = extract_local_tensor(t)
    assert copy.tolist() == [0.0, 1.0, 2.0] and copy.grad is None
    assert copy.data_ptr() != t.data_ptr()
    copy.add_(1)
    assert t.tolist() == [0.0, 1.0, 2.0]


# ------------------------------------------------------------------ HTTPTransport


def test_allow_checkpoint_accepts_only_the_staged_step() -> None:
    transport: HTTPTransport = HTTPTransport(
        timeout=timedelta(seconds=5), num_chunks=0, advertise_host="127.0.0.1"
    )
    try:
        with pytest.raises(CheckpointError, match="no checkpoint of step 3"):
            transport.allow_checkpoint(3)  # nothing staged yet
        transport.send_checkpoint([1], 3, {"x": torch.ones(2)}, timedelta(seconds=5))
        transport.allow_checkpoint(3)  # served already: nothing to do
        with pytest.raises(CheckpointError, match="staged: 3"):
            transport.allow_checkpoint(4)
        transport.disallow_checkpoint()
        with pytest.raises(CheckpointError):
            transport.allow_checkpoint(3)  # withdrawn: send_checkpoint again
    finally:
        transport.shutdown()


# ------------------------------------------------------------------ ParameterServer


class _DoublingServer(ParameterServer):
    """Each session: one allreduce where the server contributes twice the client's ones."""

    sessions: List[str] = []

    @classmethod
    def new_process_group(cls) -> ft.ProcessGroupGloo:
        return ft.ProcessGroupGloo(timeout=timedelta(seconds=10))

    def forward(self, session_id: str, pg: Any) -> None:
        t = torch.full((2,), 2.0)
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        type(self).sessions.append(session_id)


def test_parameter_server_session_runs_forward_with_the_client() -> None:
    ps = _DoublingServer(port=0, host="127.0.0.1")
    try:
        assert ps.address().startswith("http://127.0.0.1:")
        pg = _DoublingServer.new_session(ps.address(), timeout=timedelta(seconds=10))
        t = torch.ones(2)
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        assert t.tolist() == [3.0, 3.0] and pg.rank() == 1 and pg.size() == 2
        pg.shutdown()
        bad = ps.address().replace("/new_session", "/other")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(bad, timeout=5)
        assert info.value.code == 404
    finally:
        ps.shutdown()
    deadline = time.monotonic() + 5
    while not _DoublingServer.sessions and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(_DoublingServer.sessions) == 1


def test_parameter_server_refuses_to_serve_everyone_unauthenticated(monkeypatch: Any) -> None:
    monkeypatch.delenv("FT_INSECURE", raising=False)
    with pytest.raises(InsecureServerError, match="parameter server"):
        _DoublingServer(port=0, host="0.0.0.0")


# ------------------------------------------------------------------ setup_logger


def test_setup_logger_is_off_by_default(monkeypatch: Any) -> None:
    import logging

    monkeypatch.delenv("TORCHFT_USE_OTEL", raising=False)
    before = list(logging.getLogger("ft.test.otel").handlers)
    ft.setup_logger("ft.test.otel")
    assert logging.getLogger("ft.test.otel").handlers == before


def test_setup_logger_names_the_missing_packages(monkeypatch: Any) -> None:
    try:
        import opentelemetry  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("opentelemetry is installed")
    monkeypatch.setenv("TORCHFT_USE_OTEL", "true")
    with pytest.raises(ImportError, match="opentelemetry-sdk"):
        ft.setup_logger("ft.test.otel")


def test_errored_wraps_every_error_type_ft_raises_and_keeps_its_type():
    """ExceptionWithTraceback must be constructible for each error a Manager reports: the
    checkpoint errors have two built-in bases (RuntimeError and OSError via urllib's
    HTTPError), where only one may allocate the instance."""
    import grpc

    from ft.checkpointing import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointNotAvailableError,
    )
    from ft.coordination import CoordinationError
    from ft.manager import ExceptionWithTraceback

    errors = [
        CheckpointNotAvailableError("source failed to produce step 0", 404, "http://h:1/x"),
        CheckpointCorruptError("range 3: CRC mismatch"),
        CheckpointError("plain"),
        CoordinationError(grpc.StatusCode.UNAVAILABLE, "down", "Quorum"),
        TimeoutError("late"),
        ConnectionResetError(104, "reset"),
        RuntimeError("boom"),
    ]
    for e in errors:
        wrapped = ExceptionWithTraceback(e)
        assert isinstance(wrapped, ExceptionWithTraceback) and isinstance(wrapped, type(e)), e
        assert wrapped.original_exception is e
        assert str(e) in str(wrapped)


def test_a_failed_collective_issued_straight_on_the_group_vetoes_the_commit() -> None:
    """FSDP/HSDP issue collectives on the Manager's process group themselves, not through
    manager.allreduce. When such a collective fails (here: a peer never joins it, so it times
    out and the group's error is set), should_commit must say no, and the next step, on a
    reconfigured group, commits."""
    lh = lighthouse(min_replicas=2)
    ms = replica_managers(lh.address(), 2, use_async_quorum=False, pg_timeout=timedelta(seconds=1))
    try:

        def failing_step(i: int, m: ft.Manager) -> Any:
            m.start_quorum()
            if i == 1:
                m._pg.allreduce([torch.ones(2)])  # its peer never joins; nobody waits on it
                deadline = time.monotonic() + 10
                while m._pg.errored() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert m._pg.errored() is not None, "the lone collective did not time out"
            return m.should_commit()

        def good_step(i: int, m: ft.Manager) -> Any:
            m.start_quorum()
            t = torch.full((2,), float(i + 1))
            m.allreduce(t).wait()
            return t.tolist(), m.should_commit()

        out = on_each(ms, good_step)
        assert [o[1] for o in out] == [True, True]  # step 0 (and its init_sync heal)
        out = on_each(ms, failing_step)
        assert out[1] is False, "the group's own error did not veto the commit"
        assert ms[1].errored() is not None
        # The next quorum reconfigures the group (g1 reports a failed commit) and g1 heals.
        for _ in range(2):
            out = on_each(ms, good_step)
        assert [o[1] for o in out] == [True, True] and out[0][0] == [1.5, 1.5]
    finally:
        in_threads([lambda m=m: m.shutdown() for m in ms])
        lh.shutdown()


def test_manager_timeout_bounds_its_collectives() -> None:
    """Manager(timeout=1s) over a group built with a 60 s op timeout: an allreduce whose peer
    never joins ends (reported, the step does not commit) within the Manager's timeout."""
    lh = lighthouse(min_replicas=2)
    ms = replica_managers(
        lh.address(),
        2,
        use_async_quorum=False,
        pg_timeout=timedelta(seconds=60),
        timeout=timedelta(seconds=1),
    )
    try:
        assert all(m._pg.timeout == timedelta(seconds=1) for m in ms)

        def step(i: int, m: ft.Manager) -> Any:
            m.start_quorum()
            t0 = time.monotonic()
            if i == 1:
                m.allreduce(torch.ones(2)).wait()  # g0 never joins it
            took = time.monotonic() - t0
            return took, m.should_commit()

        out = on_each(ms, step)
        assert out[1][0] < 5.0, f"the lone allreduce took {out[1][0]:.1f}s (Manager timeout 1s)"
        assert out[1][1] is False and isinstance(ms[1].errored(), Exception)
    finally:
        in_threads([lambda m=m: m.shutdown() for m in ms])
        lh.shutdown()


def test_group_rank_1_needs_no_lighthouse_address(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchft reads TORCHFT_LIGHTHOUSE on group rank 0 only; rank 0 hands it to the others
    # (through the group's store, under torchft's root keys on a first start).
    import socket

    from ft.manager import LIGHTHOUSE_ADDR_KEY, MANAGER_ADDR_KEY

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    lh = lighthouse(min_replicas=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ms: List[ft.Manager] = values(
        in_threads(
            [
                lambda: make_manager(lh.address(), "g", rank=0, world_size=2, store_port=port),
                lambda: make_manager(None, "g", rank=1, world_size=2, store_port=port),
            ]
        )
    )
    try:
        assert ms[1]._lighthouse_addr == lh.address()
        assert ms[0]._store.get(LIGHTHOUSE_ADDR_KEY).decode() == lh.address()
        assert ms[0]._store.get(MANAGER_ADDR_KEY).decode() == ms[0]._manager.address()
        with pytest.raises(ValueError, match="lighthouse_addr is required"):
            make_manager(None, "h", rank=0, world_size=1)
    finally:
        for m in ms:
            m.shutdown(wait=False)
