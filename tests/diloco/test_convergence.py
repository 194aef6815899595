"""Convergence: DiLoCo (H = 20) vs DDP at equal samples on a small regression
task. Uses the in-thread FakeManager (tests/diloco/fake_manager.py) to stay
fast; the communication paths are covered by the multi-process tests."""

from __future__ import annotations

import threading

import torch
from torch import nn

from ft.local_sgd import DiLoCo
from tests.diloco.fake_manager import FakeManager, run_replicas

STEPS, REPLICAS = 400, 2


_init_lock = threading.Lock()


def _model():
    # Replicas are threads here; torch's global RNG is shared, so seed and
    # draw under a lock or two replicas interleave their draws.
    with _init_lock:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(step, rank, n=32):
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(n, 8, generator=g)
    w = torch.linspace(-1, 1, 32).view(8, 4)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 4, generator=g)


def _eval(model):
    x, y = _batch(999_999, 99, n=2048)
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def _ddp(rank, group):
    m = FakeManager(group, rank)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for s in range(STEPS):
        x, y = _batch(s, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.view(-1) for g in grads])
        m.allreduce(flat).wait()  # one bucket, like DDP
        off = 0
        for g in grads:
            g.copy_(flat[off : off + g.numel()].view_as(g))
            off += g.numel()
        opt.step()
    return _eval(model)


def _diloco(rank, group):
    m = FakeManager(group, rank)
    model = _model()
    inner = torch.optim.Adam(model.parameters(), lr=3e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with DiLoCo(m, [model], inner, outer, sync_every=20):
        for s in range(STEPS):
            x, y = _batch(s, rank)
            inner.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            inner.step()
    return _eval(model)


def test_diloco_h20_close_to_ddp():
    torch.set_num_threads(1)
    ddp = run_replicas(REPLICAS, _ddp)
    dil = run_replicas(REPLICAS, _diloco)
    assert len(set(ddp)) == 1 and len(set(dil)) == 1  # replicas agree
    x, y = _batch(999_999, 99, n=2048)
    start = nn.functional.mse_loss(_model()(x), y).item()
    print(f"\nheld-out MSE: start {start:.4f}, DDP {ddp[0]:.4f}, DiLoCo H=20 {dil[0]:.4f}")
    assert dil[0] < 0.2 * start
    assert dil[0] <= ddp[0] * 1.10 + 0.01  # within a few percent (loose bound)
