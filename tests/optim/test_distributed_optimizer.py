"""ft.optim.distributed_optimizer: the two-phase owner-side optimizer (in process), and
DistributedOptimizer over torch.distributed.rpc with 1 driver + 2 workers in real processes
(TensorPipe on 127.0.0.1): bitwise a local optimizer's update; a failed or killed owner makes
step() raise, naming it, and leaves the others as they were. Every wait is bounded and every
child reaped (tests.procs.Workers)."""

from __future__ import annotations

import signal
import time

import pytest
import torch
import torch.distributed.rpc as rpc
from torch import nn

pytestmark = [
    pytest.mark.skipif(
        not rpc.is_available(),
        reason="torch.distributed.rpc is not available in this torch build, so "
        "ft.optim.DistributedOptimizer cannot be used or tested",
    ),
    pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning"),
]

RPC_TIMEOUT = 5.0  # the SIGSTOP case waits it out once


# --------------------------------------------------------------------------- owner side, in process


def _owner(opt_cls=torch.optim.Adam, **kw):
    from ft.optim.distributed_optimizer import _LocalOptimizer

    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    ref = nn.Linear(3, 2)
    ref.load_state_dict(m.state_dict())
    return m, _LocalOptimizer(opt_cls, list(m.parameters()), **(kw or {"lr": 0.1})), ref


def _grads(m: nn.Module, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {p: torch.randn(p.shape, generator=g) for p in m.parameters()}


def _snap(m, lo):
    return (
        [p.detach().clone() for p in m.parameters()],
        {
            k: v.clone() if torch.is_tensor(v) else v
            for st in lo.optim.state.values()
            for k, v in st.items()
        },
    )


def test_prepare_changes_nothing_and_commit_is_the_local_step():
    m, lo, ref = _owner()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    for step in range(3):
        grads = _grads(m, step)
        params_before = [p.detach().clone() for p in m.parameters()]
        state_before = {
            id(p): {k: v.clone() for k, v in lo.optim.state[p].items()}
            for p in m.parameters()
            if p in lo.optim.state
        }
        lo.prepare(f"t{step}", grads)
        # prepared, not applied: parameters, state and .grad as before
        assert all(torch.equal(a, b) for a, b in zip(params_before, m.parameters()))
        assert {
            id(p): {k: v.clone() for k, v in lo.optim.state[p].items()}
            for p in m.parameters()
            if p in lo.optim.state
        }.keys() == state_before.keys()
        assert all(p.grad is None for p in m.parameters())
        lo.commit(f"t{step}")
        for p, q in zip(ref.parameters(), m.parameters()):
            p.grad = grads[q].clone()
        ref_opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), m.parameters())), step
    for p, q in zip(ref.parameters(), m.parameters()):
        st, sq = ref_opt.state[p], lo.optim.state[q]
        assert all(torch.equal(st[k], sq[k]) for k in st)


def test_abort_and_failed_prepare_leave_everything_as_it_was():
    m, lo, _ = _owner()
    lo.prepare("a", _grads(m, 0))
    lo.commit("a")
    before = _snap(m, lo)
    lo.prepare("b", _grads(m, 1))
    lo.abort("b")
    with pytest.raises(RuntimeError, match="no prepared step b"):
        lo.commit("b")
    after = _snap(m, lo)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert all(
        torch.equal(before[1][k], after[1][k])
        if torch.is_tensor(before[1][k])
        else before[1][k] == after[1][k]
        for k in before[1]
    )
    # a gradient of the wrong shape makes the optimizer raise mid-step: rolled back
    bad = {p: torch.ones(7) for p in m.parameters()}
    with pytest.raises(RuntimeError):
        lo.prepare("c", bad)
    after = _snap(m, lo)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    with pytest.raises(RuntimeError, match="no prepared step c"):
        lo.commit("c")


def test_commit_refuses_parameters_written_since_prepare():
    m, lo, _ = _owner(torch.optim.SGD, lr=0.1)
    lo.prepare("x", _grads(m, 0))
    with torch.no_grad():
        m.weight.add_(1.0)  # e.g. another optimizer's commit
    written = m.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"parameters \[0\] of this owner were written"):
        lo.commit("x")
    assert torch.equal(m.weight, written)


def test_parameters_without_gradient_are_not_updated():
    m, lo, _ = _owner(torch.optim.SGD, lr=0.1, momentum=0.9)
    w0, b0 = m.weight.detach().clone(), m.bias.detach().clone()
    lo.prepare("x", {m.weight: torch.ones(2, 3)})
    lo.commit("x")
    assert not torch.equal(m.weight, w0) and torch.equal(m.bias, b0)


def test_needs_parameter_rrefs():
    from ft.optim.distributed_optimizer import DistributedOptimizer

    with pytest.raises(ValueError, match="no parameter RRefs"):
        DistributedOptimizer(torch.optim.SGD, [], lr=0.1)


# --------------------------------------------------------------------------- over RPC


def _wait_key(store, key: str, w, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        for c in w.children:
            if c.proc.poll() is not None:
                raise AssertionError(
                    f"child {c.rank} exited early ({c.proc.returncode}):\n{c.log()}"
                )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no {key!r} from the driver within {timeout}s:\n"
                + "\n".join(c.log()[-2000:] for c in w.children)
            )
        time.sleep(0.02)


def test_driver_and_two_workers_bitwise_then_failures_apply_nowhere():
    """4 Adam steps equal a local Adam bitwise (parameters on worker1, worker2 and the driver);
    then worker2's optimizer raises, worker2 hangs (SIGSTOP), worker2 is killed -9: each time
    step() raises StepNotApplied naming worker2, within the RPC timeout, and the parameters
    and optimizer state of worker1 and the driver are bitwise as before."""
    from tests.procs import Workers, free_port, make_store

    store = make_store()
    env = {"TP_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    with Workers(
        "tests.optim._distopt_worker:main",
        3,
        store,
        env=env,
        rpc_port=free_port(),
        rpc_timeout=RPC_TIMEOUT,
        steps=4,
    ) as w:
        victim = w.by_rank(2)
        _wait_key(store, "stop", w, 90)
        victim.stop(timeout=5.0)
        store.set("stopped", "1")
        _wait_key(store, "kill", w, 30)
        victim.signal(signal.SIGKILL)  # a stopped process dies on SIGKILL too
        victim.proc.wait(10)
        store.set("killed", "1")
        driver, worker1 = w.join(60, [w.by_rank(0), w.by_rank(1)])
    assert worker1 == {"name": "worker1"}
    assert driver["owners"] == ["driver", "worker1", "worker2"]
    assert driver["changed"] and driver["equal"] == [True] * 4, driver["equal"]

    raised = driver["raised"]
    assert raised is not None, "step() did not raise when worker2's optimizer failed"
    assert raised["failed"] == ["worker2"], raised
    assert "worker2: raised RuntimeError('injected optimizer failure')" in raised["msg"], raised
    assert sorted(raised["unchanged"]) == ["driver", "worker1"]
    assert driver["raised_unchanged"]

    for event in ("stop", "kill"):
        res = driver[event]
        assert res is not None, f"step() did not raise after worker2 got SIG{event.upper()}"
        assert res["failed"] == ["worker2"] and "'worker2'" in res["msg"], res["msg"]
        assert "applied on no owner" in res["msg"]
        assert sorted(res["unchanged"]) == ["driver", "worker1"]
        assert driver[f"{event}_seconds"] < RPC_TIMEOUT + 5, (event, driver[f"{event}_seconds"])
        assert driver[f"{event}_unchanged"], f"{event}: a surviving owner's state changed"
    assert "timeout" in driver["stop"]["msg"].lower(), driver["stop"]["msg"]
    assert "connection lost" in driver["kill"]["msg"], driver["kill"]["msg"]
