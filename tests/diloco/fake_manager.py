"""An in-thread fake of ft.Manager, for quick unit tests of LocalSGD/DiLoCo
logic only (no servers, no process group).

Each replica is a thread with its own FakeManager; replicas share a
FakeGroup, which averages the tensors of the k-th allreduce call of every
replica and ANDs their commit votes. The multi-process tests in
test_diloco_mp.py use the real Manager and servers.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Set

import torch
from torch.distributed import ReduceOp

from tests.procs import in_threads, values


class FakeGroup:
    def __init__(self, n: int, timeout: float = 30.0) -> None:
        self.n = n
        self.timeout = timeout
        self.cond = threading.Condition()
        self.deposits: Dict[Any, Dict[int, Any]] = {}
        # The id every quorum gets; a test changes it to model a membership change.
        self.quorum_id = 1

    def exchange(self, key: Any, rank: int, value: Any) -> List[Any]:
        with self.cond:
            self.deposits.setdefault(key, {})[rank] = value
            self.cond.notify_all()
            ok = self.cond.wait_for(lambda: len(self.deposits[key]) == self.n, self.timeout)
            if not ok:
                raise TimeoutError(f"fake exchange {key!r} timed out")
            return [self.deposits[key][r] for r in range(self.n)]


class _FakeWork:
    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._done = False

    def wait(self) -> bool:
        if not self._done:
            self._done = True
            self._fn()
        return True


class FakeManager:
    """A stand-in for ft.Manager that provides ft.protocols.ManagerLike (checked by
    tests/manager/test_protocols.py). ``num_lanes`` defaults to as many lanes as any test
    has fragments, so that every fragment has a lane of its own unless a test says otherwise."""

    def __init__(
        self,
        group: FakeGroup,
        rank: int,
        fail_calls: Set[int] = frozenset(),
        use_async_quorum: bool = False,
        num_lanes: int = 64,
    ) -> None:
        self.group = group
        self.rank = rank
        self.step = 0
        self.calls = 0
        self.commit_failures = 0
        self.quorums = 0
        self.fail_calls = set(fail_calls)
        self.error: Optional[Exception] = None
        self.aborted = False  # abort_step() this step
        self.state_fns: Dict[str, Any] = {}
        self._use_async_quorum = use_async_quorum
        self._num_lanes = num_lanes
        self._quorum_id = -1
        self.lanes: List[int] = []

    @property
    def use_async_quorum(self) -> bool:
        return self._use_async_quorum

    @property
    def num_lanes(self) -> int:
        return self._num_lanes

    def wait_quorum(self) -> None:
        pass

    def send_pending_heal(self) -> None:
        pass

    def is_participating(self) -> bool:
        return True

    def participating_rank(self) -> Optional[int]:
        return self.rank

    def register_state_dict_fn(self, key, load_state_dict, state_dict) -> None:
        self.state_fns[key] = (load_state_dict, state_dict)

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout=None
    ) -> None:
        self.quorums += 1
        self._quorum_id = self.group.quorum_id
        self.error = None
        self.aborted = False

    def current_step(self) -> int:
        return self.step

    def quorum_id(self) -> int:
        """As ft.Manager's: -1 before the first quorum."""
        return self._quorum_id

    def num_participants(self) -> int:
        return self.group.n

    def errored(self):
        return self.error

    def report_error(self, e: Exception) -> None:
        self.error = e

    def abort_step(self, e: Exception) -> None:
        self.error = e
        self.aborted = True

    def step_aborted(self) -> bool:
        return self.aborted

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op=ReduceOp.AVG
    ):
        from ft.process_group import current_lane

        key = ("allreduce", self.calls)
        self.lanes.append(current_lane())
        failing = self.calls in self.fail_calls
        self.calls += 1
        mine = tensor.detach().clone()

        def run() -> None:
            values = self.group.exchange(key, self.rank, mine)
            if failing:
                self.report_error(RuntimeError("injected allreduce failure"))
                return
            total = torch.stack([v.to(torch.float64) for v in values]).sum(0)
            if reduce_op == ReduceOp.AVG:
                total = total / self.group.n
            tensor.copy_(total.to(tensor.dtype))

        return _FakeWork(run)

    def should_commit(self, timeout=None) -> bool:
        votes = self.group.exchange(
            ("commit", self.step, self.quorums), self.rank, self.error is None
        )
        ok = all(votes)
        if ok:
            self.step += 1
        else:
            self.commit_failures += 1
        self.error = None
        return ok


def run_replicas(n: int, body: Callable[[int, FakeGroup], Any]) -> List[Any]:
    """Runs body(rank, group) on n threads; returns results, re-raises errors."""
    group = FakeGroup(n)
    return values(in_threads([lambda r=r: body(r, group) for r in range(n)], timeout=60))
