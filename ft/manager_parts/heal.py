"""Healing: moving the live state between replica groups during a quorum (docs/design.md,
"Heal").

:class:`Healer` does the transfer for one Manager: it sends this group's state to the replicas
that the quorum assigns to it, and fetches the state of the replica it must heal from. The
Manager keeps the step state machine (when to heal, what to do with the state, how a failure
counts); the Healer owns the checkpoint transport's use, the clients of other groups'
ManagerServers, and the checks a received checkpoint must pass before anything loads it.

Contract:
  * ``serves(quorum)``: whether this replica stages its state for the quorum's heal: it is
    assigned receivers (``quorum.recover_dst_replica_ranks``), or it is one of several donors
    (``quorum.heal_donors``) of a striped heal and its transport stripes.
  * ``send(quorum, state_dict, timeout)`` stages ``state_dict()`` for the replica ranks in
    ``quorum.recover_dst_replica_ranks`` and for striped receivers, when ``serves(quorum)``
    (nothing otherwise). When the send fails, the transport is told to abandon the step, so
    that receivers fail their heal now (and retry at the next quorum) instead of waiting out
    their timeout; the failure is re-raised.
  * ``wait_delivered(quorum, timeout, stop)`` returns once this replica's receivers have the
    state and no striped receiver still reads it; where the heal may stripe, it first waits
    (at most :data:`DONOR_ARRIVAL_S`) for every healing replica to ask for it.
  * ``receive(quorum, group_rank, timeout, required_keys, donors)`` asks the source replica's
    ManagerServer for the checkpoint metadata of ``group_rank``, fetches the checkpoint of step
    ``quorum.max_step`` through the transport (striped over ``donors`` where the transport
    stripes), and returns it only if it has the Manager's two sections (``"user"`` and
    ``"torchft"``, both dicts) and a ``"user"`` entry for every key in ``required_keys``;
    otherwise :class:`ValueError` names what is missing.
  * Clients of other groups' ManagerServers are made by ``client_factory(address,
    connect_timeout=...)`` (default :class:`~ft.coordination.ManagerClient`; the Manager passes
    ``ft.manager.ManagerClient``) and called by torchft's names (``_checkpoint_metadata``).
    They are cached by address (closing a gRPC channel costs ~200 ms), at most
    :data:`MAX_PEER_CLIENTS` at a time; ``close()`` closes them all.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple

from ft.checkpointing.transport import CheckpointTransport
from ft.utils.deadline import Deadline
from ft.coordination import ManagerClient
from ft.coordination.quorum import QuorumResult

__all__ = ["Healer", "ReceivedCheckpoint", "MAX_PEER_CLIENTS", "DONOR_ARRIVAL_S"]

# Distinct source groups a replica heals from over a job's life are few; past this many cached
# clients the cache is emptied rather than grown (a job whose groups keep changing address).
MAX_PEER_CLIENTS = 16
# Once the assigned source's metadata is in, the other donors' (asked at the same moment) are
# waited for this much longer; a donor that has not answered by then is no source of the heal.
_HELPER_METADATA_GRACE_S = 0.5
# Where a heal may stripe, a donor waits at most this long after staging for every healing
# replica to ask it for the checkpoint, before it waits for those reading to finish: once that
# wait returns, the donor's caller changes its state and no new reader is let in. Receivers ask
# every donor as soon as they have their quorum answer (sync quorum: when the donors stage;
# async: before, their requests wait for the staging), so a receiver that stripes comes within
# milliseconds. One that does not (it fetches from a same-host source alone, or gave up on this
# donor) holds the donor this long, once per heal: short, as every other group then waits for
# this one at its next collective or quorum.
DONOR_ARRIVAL_S = 0.25
# While a source waits for its receivers (wait_delivered), it checks this often whether to stop
# (its step failed: a receiver died, say).
_STOP_POLL_S = 0.1


@dataclass(frozen=True)
class ReceivedCheckpoint:
    """A checked checkpoint and how it arrived (for the heal log)."""

    state: Dict[str, Any]
    metadata: str
    """The source's checkpoint metadata (its transport's address for this step)."""
    metadata_s: float
    """Seconds spent asking the source for the metadata."""
    path: Optional[str]
    """The transport's path for this transfer ("http", "same-host", ...), where it says."""


class Healer:
    """Sends and fetches the live state of one replica group (see the module docstring)."""

    def __init__(
        self,
        transport: CheckpointTransport[Dict[str, Any]],
        connect_timeout: timedelta,
        client_factory: Callable[..., ManagerClient] = ManagerClient,
    ) -> None:
        self.transport = transport
        self._connect_timeout = connect_timeout
        self._client_factory = client_factory
        self._peer_clients: Dict[str, ManagerClient] = {}

    def stripes(self) -> bool:
        """Whether the transport takes a heal from several donors at once (and can tell when
        they have been asked for and read)."""
        t = self.transport
        return (
            self.confirms_delivery()
            and callable(getattr(t, "recv_checkpoint_striped", None))
            and callable(getattr(t, "wait_asked", None))
        )

    def striped(self, quorum: QuorumResult) -> bool:
        """Whether the quorum's heal may take from several donors at once."""
        return len(quorum.heal_donors) > 1 and self.stripes()

    def serves(self, quorum: QuorumResult) -> bool:
        """Whether this replica stages its state for the quorum's heal: the quorum assigns it
        receivers, or it is a donor of a striped heal (docs/design.md, "Striped heal")."""
        if quorum.recover_dst_replica_ranks:
            return True
        return (
            not quorum.heal
            and self.striped(quorum)
            and any(rank == quorum.replica_rank for rank, _ in quorum.heal_donors)
        )

    def send(
        self, quorum: QuorumResult, state_dict: Callable[[], Dict[str, Any]], timeout: timedelta
    ) -> None:
        if not self.serves(quorum):
            return
        try:
            self.transport.send_checkpoint(
                dst_ranks=quorum.recover_dst_replica_ranks,
                step=quorum.max_step,
                state_dict=state_dict(),
                timeout=timeout,
            )
        except Exception as e:
            self.abandon(quorum, f"{type(e).__name__}: {e}")
            raise

    def confirms_delivery(self) -> bool:
        """Whether the transport tells when its receivers have a checkpoint, so that the
        source may keep its state unchanged until they do (and, in async mode, stage it late,
        at should_commit)."""
        return bool(getattr(self.transport, "confirms_delivery", False))

    def announce(self, quorum: QuorumResult) -> None:
        """Tells the transport that the checkpoint of ``quorum.max_step`` comes (receivers
        wait for it, even where an earlier attempt at that step withdrew or abandoned it)."""
        self._optional("expect_checkpoint")(quorum.max_step)

    def abandon(self, quorum: QuorumResult, reason: str) -> None:
        """Receivers waiting for the checkpoint of ``quorum.max_step`` fail now."""
        self._optional("abandon_checkpoint")(quorum.max_step, reason)

    def _optional(self, method: str) -> Callable[..., None]:
        """The transport's ``method``, one of ft's additions to torchft's transport interface,
        or a no-op for a transport written for torchft, which lacks them."""
        return getattr(self.transport, method, None) or (lambda *args: None)

    def wait_delivered(
        self, quorum: QuorumResult, timeout: timedelta, stop: Callable[[], bool]
    ) -> bool:
        """Waits until every receiver of ``quorum`` has the checkpoint sent for it: True; False
        at ``timeout``, or as soon as ``stop()`` (checked every ``_STOP_POLL_S``)."""
        deadline = Deadline.after(timeout)
        receivers = len(quorum.recover_dst_replica_ranks)
        if self.striped(quorum):
            # Striped receivers take a lease here only once they come (a helper's do not count
            # as deliveries): wait for every healing replica of the quorum to have asked, or
            # until it is clear that one will not.
            healing = quorum.replica_world_size - len(quorum.heal_donors)
            arrival = deadline.sooner(DONOR_ARRIVAL_S)
            while not arrival.expired and not stop():
                slice_s = min(_STOP_POLL_S, arrival.remaining())
                if self.transport.wait_asked(  # type: ignore[attr-defined]
                    quorum.max_step, healing, timedelta(seconds=slice_s)
                ):
                    break
        while True:
            slice_s = min(_STOP_POLL_S, deadline.remaining())
            if self.transport.wait_delivered(
                quorum.max_step, receivers, timedelta(seconds=slice_s)
            ):
                return True
            if deadline.expired or stop():
                return False

    def receive(
        self,
        quorum: QuorumResult,
        group_rank: int,
        timeout: timedelta,
        required_keys: Collection[str],
        donors: Sequence[Tuple[int, str]] = (),
    ) -> ReceivedCheckpoint:
        """Fetches and checks the checkpoint (see the module docstring). ``donors``: (replica
        rank, ManagerServer address) of other replicas at ``quorum.max_step`` that may serve
        the same checkpoint: where the transport stripes (``recv_checkpoint_striped``), the
        heal takes disjoint ranges from all of them and the assigned source at once."""
        src = quorum.recover_src_replica_rank
        if src is None or not quorum.recover_src_manager_address:
            raise ValueError(
                f"quorum {quorum.quorum_id} asks this replica to heal but names no "
                f"source (rank {src!r}, address "
                f"{quorum.recover_src_manager_address!r})"
            )
        t0 = time.monotonic()
        striped = getattr(self.transport, "recv_checkpoint_striped", None)
        helpers = [
            (rank, addr)
            for rank, addr in donors
            if addr and addr != quorum.recover_src_manager_address
        ]
        if striped is None or not helpers:
            peer = self._peer_client(quorum.recover_src_manager_address)
            # torchft's name for the ManagerClient call (a stand-in written for it works here)
            metadata = peer._checkpoint_metadata(group_rank, timeout=timeout)
            metadata_s = time.monotonic() - t0
            state = self.transport.recv_checkpoint(
                src_rank=src, metadata=metadata, step=quorum.max_step, timeout=timeout
            )
        else:
            sources = self._donor_metadata(
                [(src, quorum.recover_src_manager_address), *helpers], group_rank, timeout
            )
            metadata = sources[0][1]
            metadata_s = time.monotonic() - t0
            state = striped(sources=sources, step=quorum.max_step, timeout=timeout)
        check_checkpoint(state, required_keys)
        return ReceivedCheckpoint(state, metadata, metadata_s, self.transport.last_recv_path)

    def _donor_metadata(
        self, donors: List[Tuple[int, str]], group_rank: int, timeout: timedelta
    ) -> List[Tuple[int, str]]:
        """(rank, checkpoint metadata) of every donor that answers, asked at once, the
        assigned one (first) included; its failure is the heal's failure, as without
        striping. A helper that does not answer in time is no source of this heal."""
        answers: List[Optional[str]] = [None] * len(donors)
        errors: List[Optional[BaseException]] = [None] * len(donors)
        clients = [self._peer_client(addr) for _, addr in donors]

        def ask(i: int) -> None:
            try:
                # torchft's name for the ManagerClient call, as above
                answers[i] = clients[i]._checkpoint_metadata(group_rank, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - judged below
                errors[i] = e

        threads = [
            threading.Thread(target=ask, args=(i,), daemon=True, name="ft-heal-donor")
            for i in range(len(donors))
        ]
        for t in threads:
            t.start()
        # the assigned source is waited for as long as a single-source heal would; helpers
        # no longer than it
        deadline = Deadline.after(timeout)
        threads[0].join(deadline.remaining())
        helpers_by = deadline.sooner(_HELPER_METADATA_GRACE_S)
        for t in threads[1:]:
            t.join(helpers_by.remaining())
        if errors[0] is not None:
            raise errors[0]
        if answers[0] is None:
            raise TimeoutError(
                f"the assigned source's ManagerServer {donors[0][1]} did not answer in {timeout}"
            )
        return [(donors[i][0], a) for i, a in enumerate(answers) if a is not None]

    def close(self) -> None:
        for peer in self._peer_clients.values():
            peer.close()
        self._peer_clients.clear()

    def _peer_client(self, address: str) -> ManagerClient:
        client = self._peer_clients.get(address)
        if client is None:
            if len(self._peer_clients) >= MAX_PEER_CLIENTS:
                self.close()
            client = self._client_factory(address, connect_timeout=self._connect_timeout)
            self._peer_clients[address] = client
        return client


def check_checkpoint(state: Any, required_keys: Collection[str]) -> None:
    """Raises ValueError unless ``state`` is a Manager checkpoint with every required key."""
    if (
        not isinstance(state, dict)
        or not isinstance(state.get("user"), dict)
        or not isinstance(state.get("torchft"), dict)
    ):
        raise ValueError("received checkpoint lacks the 'user'/'torchft' sections")
    missing = set(required_keys) - set(state["user"])
    if missing:
        raise ValueError(f"received checkpoint lacks state for keys {sorted(missing)}")
