"""In-process Manager tests: real lighthouse, ManagerServers and ft process groups, with one
Manager per thread (cheap), plus the wrappers (DDP, Optimizer, DistributedSampler)."""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import timedelta
from typing import Any, Iterator, List

import pytest
import torch
import torch.distributed as dist

import ft
from ft.checkpointing import HTTPTransport
from tests.manager.inproc import (
    on_each,
    in_threads,
    lighthouse,
    make_manager,
    replica_managers,
    tensor_managers,
    values,
)


@pytest.fixture
def lh():
    server = lighthouse(min_replicas=1)
    yield server
    server.shutdown()


def managers(lh: Any, n: int, **kw: Any) -> List[ft.Manager]:
    # all start before the first quorum: min_replicas=n for the first one is set by the caller
    return replica_managers(lh.address(), n, **kw)


def shutdown(ms: List[ft.Manager]) -> None:
    in_threads([lambda m=m: m.shutdown() for m in ms])


@contextlib.contextmanager
def two_replicas(**kw: Any) -> Iterator[List[ft.Manager]]:
    """A lighthouse that waits for both, and the Managers of replicas g0 and g1 (``kw``: any
    other Manager argument); all shut down on exit."""
    lh = lighthouse(min_replicas=2)
    ms = managers(lh, 2, **kw)
    try:
        yield ms
    finally:
        shutdown(ms)
        lh.shutdown()


def test_quorum_timeout_with_missing_rank_is_fast(lh: Any) -> None:
    # A group of 2 ranks where rank 1 never shows up.
    m = make_manager(
        lh.address(),
        "g0",
        rank=0,
        world_size=2,
        use_async_quorum=False,
        quorum_timeout=timedelta(seconds=0.3),
    )
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            m.start_quorum()
        assert time.monotonic() - t0 < 1.0
        # async mode surfaces it in wait_quorum / allreduce
        m._use_async_quorum = True
        t0 = time.monotonic()
        m.start_quorum()
        with pytest.raises(TimeoutError):
            m.allreduce(torch.ones(2))
        assert time.monotonic() - t0 < 1.0
    finally:
        m.shutdown()


def test_max_retries_raises(lh: Any) -> None:
    m = make_manager(lh.address(), "g0", min_replica_size=2, max_retries=2, use_async_quorum=False)
    try:
        for _ in range(2):
            m.start_quorum()
            m.allreduce(torch.ones(2)).wait()
            assert m.should_commit() is False
        m.start_quorum()
        with pytest.raises(RuntimeError, match="max_retries=2"):
            m.should_commit()
        assert m.current_step() == 0
    finally:
        m.shutdown()


def test_fixed_with_spares_numerics() -> None:
    lh = lighthouse(min_replicas=3)
    ms = managers(
        lh,
        3,
        min_replica_size=2,
        use_async_quorum=False,
        world_size_mode=ft.WorldSizeMode.FIXED_WITH_SPARES,
    )
    try:

        def step(i: int, m: ft.Manager) -> Any:
            m.start_quorum()
            t = torch.full((4,), float(m.participating_rank() or 0) + 1.0)
            t.fill_(10.0 * (i + 1))
            m.allreduce(t).wait()
            return (
                t.tolist(),
                m.num_participants(),
                m.is_participating(),
                m.should_commit(),
                m.batches_committed(),
                m.participating_rank(),
            )

        out = on_each(ms, step)
        # replica ids sort as g0 < g1 < g2: g2 is the spare and contributes zeros
        for vals, n, _participating, committed, batches, _prank in out:
            assert vals == [15.0] * 4  # (10 + 20) / 2
            assert n == 2 and committed and batches == 2
        assert [o[2] for o in out] == [True, True, False]
        assert [o[5] for o in out] == [0, 1, None]
    finally:
        shutdown(ms)
        lh.shutdown()


def test_init_sync_false_seeded_identical_init_no_heal() -> None:
    lh = lighthouse(min_replicas=2)
    loads: List[int] = []
    models = []
    for _ in range(2):
        torch.manual_seed(7)
        models.append(torch.nn.Linear(3, 2))
    ms = replica_managers(
        lh.address(),
        2,
        lambda i: dict(state_dict=models[i].state_dict),
        init_sync=False,
        use_async_quorum=False,
        load_state_dict=lambda sd: loads.append(1),
    )
    try:

        def run(i: int, m: ft.Manager) -> Any:
            opt = ft.Optimizer(m, torch.optim.SGD(models[i].parameters(), lr=0.1))
            for s in range(3):
                opt.zero_grad()
                models[i](torch.full((1, 3), float(i + s))).sum().backward()
                for p in models[i].parameters():
                    m.allreduce(p.grad).wait()
                opt.step()
            return m.current_step()

        assert on_each(ms, run) == [3, 3]
        assert loads == []  # nobody healed at step 0
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b)
    finally:
        shutdown(ms)
        lh.shutdown()


def test_allreduce_avg_sum_errors_and_async_heal() -> None:
    lh = lighthouse(min_replicas=2)
    state = [torch.zeros(3), torch.ones(3)]
    ms = tensor_managers(lh.address(), state, use_async_quorum=True)
    try:

        def step(i: int, m: ft.Manager, op: Any, err: bool) -> Any:
            m.start_quorum()
            t = torch.full((2,), float(i + 1))
            w = m.allreduce(t, reduce_op=op)
            assert w.wait() is True
            fut_val = w.get_future().wait()
            if err:
                m.report_error(RuntimeError("boom"))
                # still communicates: the group is usable and every group issues it
                later = torch.ones(1)
                assert m.allreduce(later, reduce_op=dist.ReduceOp.SUM).wait() is True
                assert later.item() == 2.0
            return t.tolist(), fut_val is t, m.is_participating(), m.should_commit()

        # step 0, async + init_sync: g1 heals (contributes zeros, not a participant)
        out = on_each(ms, step, dist.ReduceOp.AVG, False)
        assert out[0] == ([1.0, 1.0], True, True, True)
        assert out[1] == ([1.0, 1.0], True, False, True)
        assert torch.equal(state[1], state[0])  # healed state applied in should_commit
        out = on_each(ms, step, dist.ReduceOp.SUM, False)
        assert [o[0] for o in out] == [[3.0, 3.0]] * 2 and all(o[3] for o in out)
        # a reported error (after the allreduce, e.g. a NaN loss): the step does not commit
        out = on_each(ms, step, dist.ReduceOp.AVG, True)
        assert [o[0] for o in out] == [[1.5, 1.5]] * 2
        assert [o[3] for o in out] == [False, False]
        assert ms[1].errored() is not None and ms[0].errored() is not None
        # recovers on the next step
        out = on_each(ms, step, dist.ReduceOp.AVG, False)
        assert [o[0] for o in out] == [[1.5, 1.5]] * 2 and all(o[3] for o in out)
        assert [m.current_step() for m in ms] == [3, 3]
        assert [m.batches_committed() for m in ms] == [1 + 2 + 2, 1 + 2 + 2]

        # should_quantize: int8 on the wire, fp32 accumulation, AVG over participants
        def quantized(i: int, m: ft.Manager, wire: Any) -> Any:
            m.start_quorum()
            g = torch.Generator().manual_seed(i)
            t = torch.randn(1000, generator=g)
            exact = t.clone()
            m.allreduce(t, should_quantize=wire).wait()
            return t, exact, m.should_commit()

        results = {}
        for wire in (True, torch.float8_e4m3fn):  # int8, and the fp8 extension
            out = on_each(ms, quantized, wire)
            want = (out[0][1] + out[1][1]) / 2
            assert torch.equal(out[0][0], out[1][0])  # every replica gets the same result
            rel = ((out[0][0] - want).abs().mean() / want.abs().mean()).item()
            assert rel < 0.05, (wire, rel)
            assert not torch.equal(out[0][0], want)  # it really was quantized
            assert all(o[2] for o in out)
            results[wire] = out[0][0]
        assert not torch.equal(results[True], results[torch.float8_e4m3fn])  # really fp8
    finally:
        shutdown(ms)
        lh.shutdown()


def test_async_heal_source_reads_its_state_on_the_training_thread_after_backward() -> None:
    """Async quorum: the heal source reads the state it sends on its training thread, after
    the step's forward and backward (at should_commit), never on the quorum thread while
    forward runs (where FSDP2's state-dict hooks would swap the parameters forward uses). The
    healing replica's collectives do not wait for its heal; it ends identical to the source."""
    import threading

    lh = lighthouse(min_replicas=2)
    state = [torch.zeros(3), torch.full((3,), 7.0)]
    training = [None, None]
    phase = ["", ""]
    reads: List[Any] = []

    def state_dict(i: int) -> Any:
        reads.append((i, threading.current_thread() is training[i], phase[i]))
        return {"w": state[i]}

    ms = tensor_managers(lh.address(), state, state_dict, use_async_quorum=True)
    try:

        def step(i: int, m: ft.Manager) -> Any:
            training[i] = threading.current_thread()
            m.start_quorum()
            phase[i] = "forward"
            time.sleep(0.3)  # long enough for a quorum thread to read the state meanwhile
            phase[i] = "backward"
            grad = torch.full((3,), float(i + 1))
            m.allreduce(grad).wait()  # the healing replica's does not wait for its heal
            phase[i] = "commit"
            ok = m.should_commit()
            phase[i] = ""
            if ok:
                state[i].sub_(grad)
            return ok, m.is_participating()

        for _ in range(3):
            out = on_each(ms, step)
            assert [ok for ok, _ in out] == [True, True], out
        sources = [r for r in reads if r[0] == 0]
        assert sources, "the source never sent its state"
        assert all(on_training and ph == "commit" for _, on_training, ph in sources), sources
        assert torch.equal(state[0], state[1])  # healed at step 0, then stepped alike
        assert torch.equal(state[0], torch.full((3,), -4.0))  # 0 - 1 (the source alone) - 1.5 - 1.5
    finally:
        shutdown(ms)
        lh.shutdown()


class _SlowSource(HTTPTransport):
    """Serves (and checksums) 1 MiB slices slowly, so that a transfer lasts ~0.5 s."""

    def _pace(self) -> None:
        time.sleep(0.1)


@pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "http"])
def test_sync_heal_source_keeps_its_state_until_the_receiver_has_it(same_host: bool) -> None:
    """Sync quorum: the source stages references to its tensors at the quorum, and its
    training thread changes them as soon as start_quorum returns (as a DiLoCo inner step
    does). start_quorum must return only once the receiver has the state: the receiver then
    heals to the source's state at the quorum, not to a changed (or torn) one."""
    lh = lighthouse(min_replicas=2)
    n = 5 << 18  # 5 MiB of float32: five paced slices
    state = [torch.full((n,), 7.0), torch.zeros(n)]
    ms = tensor_managers(
        lh.address(),
        state,
        use_async_quorum=False,
        per_replica=lambda i: {
            "checkpoint_transport": _SlowSource(
                timeout=timedelta(seconds=10),
                num_chunks=0,
                advertise_host="127.0.0.1",
                same_host=same_host,
            )
        },
    )
    try:

        def step(i: int, m: ft.Manager) -> Any:
            m.start_quorum()  # step 0: g1 heals from g0 (init_sync)
            state[i].add_(100.0)  # the caller's next change, right away
            m.allreduce(torch.ones(1)).wait()
            return m.should_commit(), m.errored()

        out = on_each(ms, step)
        assert [o[0] for o in out] == [True, True], out
        assert torch.equal(state[1], state[0]), (state[0][:2], state[1][:2])
        assert torch.equal(state[0], torch.full((n,), 107.0))
    finally:
        shutdown(ms)
        lh.shutdown()


def test_wrap_future_honours_its_timeout(lh: Any) -> None:
    import threading

    m = make_manager(lh.address(), "g0", use_async_quorum=False)
    try:
        # completes in time: its value, nothing reported
        ok: torch.futures.Future = torch.futures.Future()
        wrapped_ok = m.wrap_future(ok, default=-1, timeout=timedelta(seconds=5))
        ok.set_result(7)
        assert wrapped_ok.wait() == 7 and m.errored() is None

        # never completes: the default after the timeout, and a reported TimeoutError
        never: torch.futures.Future = torch.futures.Future()
        done = threading.Event()
        t0 = time.monotonic()
        wrapped = m.wrap_future(never, default=42, timeout=timedelta(seconds=0.3))
        wrapped.add_done_callback(lambda f: done.set())
        assert done.wait(0.8 - (time.monotonic() - t0)), "still pending after 0.8s"
        assert time.monotonic() - t0 >= 0.25
        assert wrapped.value() == 42
        assert isinstance(m.errored(), TimeoutError)
        never.set_result(1)  # a late completion changes nothing
        assert wrapped.value() == 42

        # fails: the default, and the failure reported
        m.start_quorum()
        bad: torch.futures.Future = torch.futures.Future()
        wrapped_bad = m.wrap_future(bad, default=0)
        bad.set_exception(RuntimeError("nope"))
        assert wrapped_bad.wait() == 0 and "nope" in str(m.errored())
        assert m.should_commit() is False
    finally:
        m.shutdown()


def _quorum_and_allreduce(i: int, m: ft.Manager) -> List[float]:
    """Starts the step (its quorum) and allreduces (averages) ``[i + 1, i + 1]`` on replica
    ``i``; returns the result."""
    m.start_quorum()
    t = torch.full((2,), float(i + 1))
    m.allreduce(t).wait()
    return t.tolist()


def test_report_error_fails_the_step_but_keeps_the_process_group() -> None:
    with two_replicas(use_async_quorum=False) as ms:

        def step(i: int, m: ft.Manager, err: bool) -> Any:
            t = _quorum_and_allreduce(i, m)
            if err and i == 1:
                m.report_error(RuntimeError("NaN loss"))  # skip this step
            # the process group is not aborted: a collective on it still works this step
            raw = torch.full((1,), float(i + 1))
            m._pg.allreduce([raw]).wait()
            # and so does the Manager's allreduce: g0, which knows nothing of g1's error, issues
            # it too, and must not wait for g1 until its timeout
            later = torch.full((1,), float(i + 1))
            m.allreduce(later, reduce_op=dist.ReduceOp.SUM).wait()
            return t, (raw.item(), later.item()), m._pg.errored(), m.should_commit()

        out = on_each(ms, step, False)
        assert all(o[3] for o in out)
        out = on_each(ms, step, True)
        assert [o[0] for o in out] == [[1.5, 1.5]] * 2
        assert [o[1] for o in out] == [(3.0, 3.0)] * 2
        assert [o[2] for o in out] == [None, None]
        # should_commit is the vote of each replica group, as in torchft: only g1 skips the step
        assert [o[3] for o in out] == [True, False]
        assert ms[0].errored() is None and isinstance(ms[1].errored(), RuntimeError)
        # the next step commits (g1 heals from g0 first)
        out = on_each(ms, step, False)
        assert [o[3] for o in out] == [True, True]
        assert [m.current_step() for m in ms] == [3, 3]


def test_abort_step_fails_the_step_and_the_peers_collectives_then_recovers() -> None:
    """abort_step(): for code that cannot issue the collectives its peers expect. g1 aborts and
    skips its later allreduce (a no-op on g1 now); g0's matching allreduce fails with the abort
    (instead of waiting for g1 until its op timeout), so neither commits; the next step
    reconfigures the group and both commit."""
    with two_replicas(use_async_quorum=False) as ms:

        def step(i: int, m: ft.Manager, abort: bool) -> Any:
            t = _quorum_and_allreduce(i, m)
            if abort and i == 1:
                m.abort_step(RuntimeError("cannot issue this step's exchange"))
            skipped = None
            if abort:  # g1 issues it after its abort, g0 as its part of the step's exchange
                later = torch.full((1,), 7.0)
                m.allreduce(later, reduce_op=dist.ReduceOp.SUM).wait()
                skipped = later.item() if i == 1 else None
            return t, skipped, m.step_aborted(), str(m.errored()), m.should_commit()

        out = on_each(ms, step, True)
        assert [o[0] for o in out] == [[1.5, 1.5]] * 2
        assert out[1][1] == 7.0  # g1's allreduce after its abort did not communicate
        assert out[1][2] is True
        assert "cannot issue this step's exchange" in out[1][3]
        assert out[0][3] != "None", "g0's allreduce did not fail with g1's abort"
        assert [o[4] for o in out] == [False, False]
        out = on_each(ms, step, False)
        assert [o[4] for o in out] == [True, True]
        assert [o[2] for o in out] == [False, False]


def test_ddp_hook_averages_and_does_not_block() -> None:
    with two_replicas(use_async_quorum=False) as ms:

        def run(i: int, m: ft.Manager) -> Any:
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2)
            ddp = ft.DistributedDataParallel(m, model)
            opt = ft.Optimizer(m, torch.optim.SGD(model.parameters(), lr=0.1))
            opt.zero_grad()
            ddp(torch.full((1, 4), float(i + 1))).sum().backward()
            g = model.weight.grad.clone()
            opt.step()
            return g, m.current_step()

        (g0, s0), (g1, s1) = on_each(ms, run)
        assert torch.equal(g0, g1) and torch.allclose(g0, torch.full((2, 4), 1.5))
        assert s0 == s1 == 1


def test_ddp_bucket_view_default_matches_copying_buckets_bitwise() -> None:
    """ft's default gradient_as_bucket_view=True trains bit-identically to torch's copying
    buckets, across steps with zero_grad(set_to_none=True) and a multi-bucket model."""
    with two_replicas(use_async_quorum=False) as ms:

        def make_model() -> torch.nn.Module:
            torch.manual_seed(0)  # the global RNG: build models here, not on the threads
            return torch.nn.Sequential(
                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
            )

        def run(i: int, m: ft.Manager, view: Any, model: torch.nn.Module) -> Any:
            kw = {} if view is None else {"gradient_as_bucket_view": view}
            ddp = ft.DistributedDataParallel(m, model, bucket_cap_mb=0.01, **kw)
            opt = ft.Optimizer(m, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
            g = torch.Generator().manual_seed(i)
            for _ in range(4):
                opt.zero_grad(set_to_none=True)
                ddp(torch.randn(16, 64, generator=g)).square().mean().backward()
                assert opt.step() is not False
            return [p.detach().clone() for p in model.parameters()], ddp.gradient_as_bucket_view

        out = {}
        for view in (None, False):
            models = [make_model() for _ in ms]
            out[view] = values(
                in_threads(
                    [
                        lambda i=i, m=m, md=md: run(i, m, view, md)
                        for i, (m, md) in enumerate(zip(ms, models))
                    ]
                )
            )
        assert [o[1] for o in out[None]] == [True, True]
        assert [o[1] for o in out[False]] == [False, False]
        for a, b, c in zip(out[None][0][0], out[None][1][0], out[False][0][0]):
            assert torch.equal(a, b), ("replicas differ", (a - b).abs().max())
            assert torch.equal(a, c), ("view vs copy differ", (a - c).abs().max())


def test_ddp_reduces_buckets_during_backward_last_layer_first() -> None:
    """ft's DDP fixes its buckets last layer first, so the first bucket's allreduce is issued
    while backward is still computing the first layer's gradients (in parameter order no
    allreduce could start before backward ended)."""
    lh = lighthouse(min_replicas=1)
    ms = managers(lh, 1, use_async_quorum=False)
    try:
        m = ms[0]
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)
        )
        events: List[str] = []
        allreduce = m.allreduce

        def recording_allreduce(t: torch.Tensor, *a: Any, **kw: Any) -> Any:
            events.append("allreduce")
            return allreduce(t, *a, **kw)

        m.allreduce = recording_allreduce  # type: ignore[method-assign]
        model[0].weight.register_hook(lambda g: events.append("first layer grad"))
        ddp = ft.DistributedDataParallel(m, model, bucket_cap_mb=0.01)
        opt = ft.Optimizer(m, torch.optim.SGD(model.parameters(), lr=0.1))
        opt.zero_grad()
        ddp(torch.randn(8, 64)).square().mean().backward()
        assert opt.step() is not False
        assert events.count("allreduce") >= 2, events
        assert events.index("allreduce") < events.index("first layer grad"), events
    finally:
        shutdown(ms)
        lh.shutdown()


def test_optimizer_wrapper_delegates() -> None:
    class FakeManager:
        def __init__(self) -> None:
            self.calls: List[str] = []
            self.commit = True

        def start_quorum(self) -> None:
            self.calls.append("quorum")

        def should_commit(self) -> bool:
            self.calls.append("commit")
            return self.commit

    p = torch.nn.Parameter(torch.ones(2))
    fm = FakeManager()
    opt = ft.Optimizer(fm, torch.optim.SGD([p], lr=1.0))  # type: ignore[arg-type]
    assert isinstance(opt, torch.optim.Optimizer)
    p.grad = torch.ones(2)
    opt.step()
    assert torch.equal(p, torch.zeros(2))
    fm.commit = False
    p.grad = torch.ones(2)
    opt.step()
    assert torch.equal(p, torch.zeros(2))
    opt.zero_grad()
    assert p.grad is None and fm.calls == ["commit", "commit", "quorum"]
    assert opt.param_groups[0]["lr"] == 1.0
    opt.load_state_dict(opt.state_dict())


def test_distributed_sampler_shards_across_groups() -> None:
    data = list(range(24))
    seen = []
    for replica in range(3):
        for r in range(2):
            s = ft.DistributedSampler(
                data,
                replica_rank=replica,
                num_replica_groups=3,
                group_rank=r,
                num_replicas=2,
                shuffle=False,
            )
            assert s.global_rank == r + 2 * replica and s.global_world_size == 6
            seen.append(list(s))
    flat = sorted(x for part in seen for x in part)
    assert flat == data


@pytest.mark.parametrize("async_quorum", [False, True])
def test_heal_source_state_dict_failure_fails_the_heal_fast_and_it_is_retried(
    async_quorum: bool,
) -> None:
    """The heal source's state_dict raises once: the step commits nowhere, the healing
    replica learns at once (not after its 10 s timeout) why, heals on the next quorum, and
    every replica ends identical."""
    from ft.checkpointing import CheckpointNotAvailableError

    lh = lighthouse(min_replicas=2)
    state = [torch.zeros(3), torch.ones(3)]
    calls = [0]

    def source_state_dict() -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("state_dict failed on purpose")
        return {"w": state[0]}

    sds = [source_state_dict, lambda: {"w": state[1]}]
    ms = tensor_managers(lh.address(), state, lambda i: sds[i](), use_async_quorum=async_quorum)
    try:

        def run(i: int, m: ft.Manager, quorum_ids: List[int]) -> Any:
            out = []
            for _ in range(3):
                m.start_quorum()
                quorum_ids.append(m.quorum_id())
                t = state[i].clone()
                m.allreduce(t).wait()
                ok = m.should_commit()
                out.append((ok, m.errored()))
                if ok:
                    state[i].add_(t)
            return out

        assert [m.quorum_id() for m in ms] == [-1, -1]
        quorum_ids: List[int] = []
        t0 = time.monotonic()
        out = on_each(ms, run, quorum_ids)
        first_quorum_id = quorum_ids[0]
        assert time.monotonic() - t0 < 8  # the heal did not wait out its 10 s timeout
        assert [o[0][0] for o in out] == [False, False]  # the failed step commits nowhere
        assert "state_dict failed on purpose" in str(out[0][0][1])
        if not async_quorum:  # in async mode the aborted allreduce may fail first
            err = out[1][0][1]
            assert isinstance(err, CheckpointNotAvailableError), err
            assert "failed to produce step 0" in str(err)
        assert all(ok for o in out for ok, _ in o[1:])
        assert [m.current_step() for m in ms] == [2, 2]
        # the failed commit bumped the quorum id once, and both replicas agree on it
        assert ms[0].quorum_id() == ms[1].quorum_id() > first_quorum_id >= 0
        assert torch.equal(state[0], state[1])
        assert calls[0] == 2  # healed once, on the retry
    finally:
        shutdown(ms)
        lh.shutdown()


def test_stalled_replica_says_what_it_waits_for(caplog: pytest.LogCaptureFixture) -> None:
    """A replica that commits nothing for longer than quorum_timeout logs, at the default
    level (WARNING), the phase it waits in, the address it waits on and the last error."""
    server = lighthouse(min_replicas=1)
    addr = server.address()
    m = make_manager(addr, "g0", use_async_quorum=False, quorum_timeout=timedelta(seconds=1.0))
    try:
        m.start_quorum()
        assert m.should_commit()
        server.shutdown()  # the lighthouse is gone for good
        caplog.set_level(logging.WARNING, logger="ft.manager")
        with pytest.raises((TimeoutError, RuntimeError)):
            m.start_quorum()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(
            "no step committed" in r.getMessage() for r in caplog.records
        ):
            time.sleep(0.05)
        msgs = [r.getMessage() for r in caplog.records if "no step committed" in r.getMessage()]
        assert msgs, "no stall warning at the default level"
        assert "waiting in quorum" in msgs[-1] and addr in msgs[-1], msgs[-1]
        assert "last error: " in msgs[-1] and "last error: none" not in msgs[-1], msgs[-1]
    finally:
        m.shutdown(wait=False)
