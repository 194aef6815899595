"""Shared helpers for the checkpoint transport tests (imported by tests and by ckpt_peer.py)."""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def payload_model() -> torch.nn.Module:
    """The model whose state (with its Adam state) the payload carries: an embedding, linear
    layers and a BatchNorm (buffers, an integer counter)."""
    return torch.nn.Sequential(
        torch.nn.Embedding(10, 8),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )


def build_state(big_mb: int = 0) -> Dict[str, Any]:
    """A deterministic Manager-style payload: model + Adam state + assorted plain values."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic reductions in both processes
    try:
        g = torch.Generator().manual_seed(1234)
        torch.manual_seed(1234)
        model = payload_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for _ in range(3):
            x = torch.randint(0, 10, (8, 2), generator=g)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    tied = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    misc = {
        "ints": [0, -1, 2**70, -(2**63), 2**63 - 1],
        "floats": [0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308],
        "str": "héllo ✓ \u0000 \"quoted\"",
        "bytes": b"\x00\xff\x10binary",
        "none": None,
        "bools": [True, False],
        "nested": [[1, [2, (3, "x", None)]], {"k": [], "e": {}}, ()],
        7: "int key",
        -3: {0: {1: [2]}},
        (1, "a"): "tuple key",
        2.5: "float key",
        None: "none key",
        b"k": "bytes key",
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "tensors": {
            "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "f16": torch.randn(4, generator=g).half(),
            "f64": torch.randn(3, 2, generator=g, dtype=torch.float64),
            "bool": torch.randn(7, generator=g) > 0,
            "int8": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
            "u8": torch.randint(0, 255, (3, 3), dtype=torch.uint8, generator=g),
            "i64_scalar": torch.tensor(7, dtype=torch.int64),
            "f32_scalar": torch.tensor(-0.0),
            "empty": torch.empty(0, 3),
            "transposed": torch.randn(3, 5, generator=g).t(),
            "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(
                memory_format=torch.channels_last
            ),
            "expanded": torch.randn(3, 1, generator=g).expand(3, 4),
            "complex": torch.randn(3, generator=g, dtype=torch.complex64),
            "special": torch.tensor([math.nan, math.inf, -math.inf, -0.0]),
        },
        "tied_a": tied,
        "tied_b": tied,
    }
    if big_mb:
        misc["big"] = torch.randn(big_mb * (1 << 18), generator=g)  # big_mb MiB of float32
    return {
        "user": {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "sched": {"last_epoch": 3, "_last_lr": [1e-3], "base_lrs": [1e-3]},
            "misc": misc,
        },
        "torchft": {"step": 7, "batches_committed": 42},
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: Any, b: Any, path: str = "sd") -> None:
    """Exact structural + bitwise equality (types, key types and order, dtypes, strides)."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        if a.numel() and 0 not in a.stride():  # expanded views arrive contiguous
            assert a.stride() == b.stride(), f"{path}: stride {a.stride()} != {b.stride()}"
        assert torch.equal(_bits(a), _bits(b)), f"{path}: tensor bytes differ"
    elif isinstance(a, dict):
        ka = [(type(k), k) for k in a]
        kb = [(type(k), k) for k in b]
        assert ka == kb, f"{path}: keys {ka} != {kb}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
        assert_same(getattr(a, "_metadata", None), getattr(b, "_metadata", None), path + "._md")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert a.hex() == b.hex(), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def check_payload(received: Dict[str, Any], big_mb: int = 0) -> None:
    """The received payload equals build_state() and loads into a model and an optimizer."""
    expected = build_state(big_mb)
    assert_same(expected, received)
    misc = received["user"]["misc"]
    assert misc["tied_a"] is misc["tied_b"], "tied tensors must stay one tensor"
    model = payload_model()
    model.load_state_dict(received["user"]["model"])
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    opt.load_state_dict(received["user"]["optim"])
    assert opt.param_groups[0]["lr"] == 1e-3
    assert_same(opt.state_dict(), expected["user"]["optim"])


def gloo_pg(store: Any, rank: int, world: int, timeout: timedelta) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world, opts)


class Peer:
    """A child process running ckpt_peer.py; talks JSON lines; every wait is bounded."""

    def __init__(self, *args: str, env: Optional[Dict[str, str]] = None) -> None:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.checkpointing.ckpt_peer", *args],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            text=True,
        )
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self._err: List[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, False), daemon=True).start()

    def _pump(self, stream: Any, out: bool) -> None:
        for line in stream:
            if out:
                self._lines.put(line)
            else:
                self._err.append(line)
        if out:
            self._lines.put(None)

    def expect(self, event: str, timeout: float = 30.0) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"peer did not report {event!r}; stderr: {self.stderr()}")
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"peer exited before {event!r}; stderr: {self.stderr()}")
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("event") == event:
                return msg
            if msg.get("event") == "error":
                raise RuntimeError(f"peer failed: {msg}")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stderr(self) -> str:
        return "".join(self._err)[-3000:]

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)

    def close(self, timeout: float = 5.0) -> None:
        """Asks the child to quit, then kills it if needed; always reaps it."""
        if self.proc.poll() is None:
            try:
                self.send("quit")
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        try:
            self.proc.wait(timeout=timeout)
        finally:
            for s in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                try:
                    if s is not None:
                        s.close()
                except OSError:
                    pass


def run_in_thread(fn) -> Dict[str, Any]:  # type: ignore[no-untyped-def]
    """Runs ``fn`` on a daemon thread; the dict gets "value" or "error", "t" (seconds) and
    "thread" (join it with a timeout)."""
    out: Dict[str, Any] = {}

    def target() -> None:
        t0 = time.monotonic()
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e
        out["t"] = time.monotonic() - t0

    th = threading.Thread(target=target, daemon=True)
    th.start()
    out["thread"] = th
    return out
