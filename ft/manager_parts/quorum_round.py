"""One step's quorum, as the Manager runs it on its worker thread (docs/design.md, "The step
protocol", step 1): the lighthouse call through the group's ManagerServer, the quorum taken in
(participation; the process group rebuilt for a new quorum), then the heal.

Contract (QuorumRound):
  * ``start(...)`` waits for the previous round, then runs this one on the worker thread, in
    the caller's CUDA device (NCCL communicators are made for the thread's current device).
  * ``decided`` is set once the quorum is taken in and the group configured, or once the
    quorum failed (then ``error``); a heal may still be arriving. Collectives wait for this
    (``wait_decided``), the vote and a sync quorum for the whole round (``wait_done``). Both
    raise the round's failure as ``failed(e)`` makes it (the persistent-failure rule).
  * A failed ``rebuild`` is reported (phase "configure", aborting the group) and ends the
    round: no heal runs.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Dict, Optional

import torch

from ft.coordination import QuorumResult
from ft.coordination.quorum import participation
from ft.manager_parts.group_rebuild import configures, store_address
from ft.manager_parts.heal_duties import HealDuties
from ft.manager_parts.managed_work import caller_cuda_device
from ft.manager_parts.progress_watch import ProgressWatch
from ft.manager_parts.step_log import StepLog
from ft.manager_parts.step_state import StepState
from ft.observability import records
from ft.observability.spans import span, span_block

__all__ = ["QuorumRound"]

# How often a wait for the decision also checks whether the round ended without deciding.
_DECIDED_POLL_S = 0.1


class QuorumRound:
    """Runs each step's quorum on the worker thread (module docstring)."""

    def __init__(
        self,
        state: StepState,
        duties: HealDuties,
        log: StepLog,
        watch: ProgressWatch,
        report: Callable[[Exception, bool, str], None],
        failed: Callable[[Exception], Exception],
        links: Callable[[], Dict[str, Any]],
        rebuild: Callable[[QuorumResult], None],
        rank: int,
        spares_above: Optional[int],
    ) -> None:
        """``links()``: the group's current ``pg``, ``client``, ``transport``, ``replica_id``
        and ``lighthouse`` address (read at each use: torchft's tests replace some);
        ``rebuild(quorum)`` rebuilds the process group for a new quorum; ``spares_above``:
        participants beyond this many are spares (WorldSizeMode.FIXED_WITH_SPARES)."""
        self._state = state
        self._duties = duties
        self._log = log
        self._watch = watch
        self._report = report
        self._failed = failed
        self._links = links
        self._rebuild = rebuild
        self._rank = rank
        self._spares_above = spares_above
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-async-quorum")
        self.future: Optional[Future] = None
        self.decided = threading.Event()
        self.error: Optional[BaseException] = None

    def close(self, wait: bool) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=True)

    def settle_previous(self) -> None:
        """Waits for the previous round; its failure was surfaced by then, or is moot."""
        if self.future is not None:
            try:
                self.future.result()
            except Exception:  # noqa: BLE001
                pass

    def start(self, allow_heal: bool, shrink_only: bool, timeout: timedelta) -> None:
        self.decided.clear()
        self.error = None
        self.future = self._executor.submit(
            self._run_on_device, caller_cuda_device(), allow_heal, shrink_only, timeout
        )

    def wait_done(self) -> None:
        """Waits for the whole round, a heal this replica receives included."""
        try:
            self.future.result()
        except Exception as e:  # noqa: BLE001 - raised again, or as what it amounts to
            self._raise(e)

    def wait_decided(self) -> None:
        """Waits until the quorum is decided and the group configured, not for a heal this
        replica receives: a healing replica's collectives contribute zeros and go on while its
        state arrives, and its source may send it only at its own should_commit."""
        fut = self.future
        if fut is None:
            raise RuntimeError("start_quorum() must be called before the step's collectives")
        # Bounded by the quorum thread, whose every call has a deadline; the future's end is
        # checked too, so that no path that skips the event can hang this.
        while not self.decided.wait(_DECIDED_POLL_S):
            if fut.done():
                break
        try:
            if fut.done():
                fut.result()
            elif self.error is not None:
                raise self.error
        except Exception as e:  # noqa: BLE001 - raised again, or as what it amounts to
            self._raise(e)

    def _raise(self, e: Exception) -> None:
        failure = self._failed(e)
        if failure is e:
            raise e
        raise failure from e

    # ------------------------------------------------------------------ the worker thread

    def _run_on_device(self, device: Optional[int], *args: Any) -> None:
        # The caller's device, not cuda:0, on a host with several GPUs (as torchft does).
        if device is not None and torch.cuda.current_device() != device:
            torch.cuda.set_device(device)
        self._run(*args)

    @span("torchft::manager::_async_quorum")
    def _run(self, allow_heal: bool, shrink_only: bool, quorum_timeout: timedelta) -> None:
        t0 = time.monotonic()
        self._watch.phase(
            "quorum",
            f"lighthouse {self._links()['lighthouse']} (through the group's ManagerServer)",
        )
        try:
            quorum = self._call(shrink_only, quorum_timeout)
        except BaseException as e:
            self._watch.error(e)
            self.error = e
            self.decided.set()
            raise
        source = self._duties.announce(quorum, allow_heal)
        defer = source and self._duties.defers()
        try:
            configured = self._take_in(quorum, t0, allow_heal)
            if configured and defer:
                # Due before the step is decided: a training thread that wait_quorum() lets go
                # on sends it at its next send_pending_heal (an optimizer-in-backward hook sends
                # it before its first update).
                self._duties.send_due = quorum
        finally:
            self.decided.set()
        if not configured:
            if source:
                self._duties.healer.abandon(
                    quorum, "the source could not configure its process group"
                )
            return
        if allow_heal:
            self._duties.run(quorum, defer)

    @span("torchft::manager::_client::_quorum")
    def _call(self, shrink_only: bool, quorum_timeout: timedelta) -> QuorumResult:
        links = self._links()
        # The group's reconfigure handle goes with the request only where the group is rebuilt
        # from the handles (it is carried through the lighthouse to every peer).
        pg = links["pg"]
        handle = {} if configures(pg) else {"reconfigure_handle": pg.get_reconfigure_handle()}
        # torchft's name for the call (GroupServerClient), so a stand-in written for torchft's
        # client drives the Manager.
        return links["client"]._quorum(
            group_rank=self._rank,
            step=self._state.step,
            checkpoint_metadata=links["transport"].metadata(),
            shrink_only=shrink_only,
            timeout=quorum_timeout,
            init_sync=self._state.init_sync,
            commit_failures=self._state.commit_failures,
            **handle,
        )

    def _take_in(self, quorum: QuorumResult, t0: float, allow_heal: bool) -> bool:
        """Participation, and the process group rebuilt for a new quorum. False: rebuilding
        failed (reported)."""
        t_quorum = time.monotonic() - t0
        plan = participation(
            quorum,
            use_async_quorum=self._state.use_async_quorum,
            allow_heal=allow_heal,
            init_sync=self._state.init_sync,
            spares_above=self._spares_above,
        )
        self._state.participation = plan
        new = self._state.enter_quorum(quorum.quorum_id, quorum.replica_ids)
        self._log.info(
            "quorum",
            f"{'new' if new else 'same'} quorum in {t_quorum * 1000:.1f} ms",
            replica_rank=quorum.replica_rank,
            replica_world_size=quorum.replica_world_size,
            participants=plan.contributors,
            commit_size=plan.commit_size,
            max_step=quorum.max_step,
            heal=quorum.heal,
            commit_failures=quorum.commit_failures,
        )
        if new and not self._rebuild_group(quorum):
            return False
        self._watch.phase("step", f"collectives with {quorum.replica_ids}")
        # Before the collectives may start: a healing replica contributes zeros.
        self._state.healing = allow_heal and quorum.heal
        return True

    def _rebuild_group(self, quorum: QuorumResult) -> bool:
        records.record(
            records.QUORUMS,
            replica_id=self._links()["replica_id"],
            rank=self._rank,
            quorum_id=quorum.quorum_id,
            step=quorum.max_step,
        )
        store = store_address(quorum, self._rank)
        self._watch.phase(
            "configure", f"store {quorum.store_address} with replicas {quorum.replica_ids}"
        )
        t1 = time.monotonic()
        try:
            with span_block("torchft::manager::_pg::configure"):
                self._rebuild(quorum)
        except Exception as e:  # noqa: BLE001
            self._log.error("configure", f"pg.configure({store}) failed")
            self._report(e, True, "configure")
            return False
        self._log.info(
            "configure",
            f"process group configured in {(time.monotonic() - t1) * 1000:.1f} ms",
            store=store,
        )
        return True
