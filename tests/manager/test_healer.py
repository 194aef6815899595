"""ft.manager_parts.heal: what a received checkpoint must hold before anything loads it, and what the Healer
does when a send fails or a quorum names no source (table tests; the transfers themselves are
covered by the heal tests with real processes)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, List

import pytest

from ft.coordination.quorum import QuorumResult
from ft.manager_parts.heal import Healer, check_checkpoint


@pytest.mark.parametrize(
    "state, required, error",
    [
        ({"user": {"model": 1}, "torchft": {"step": 3}}, ["model"], None),
        ({"user": {"model": 1, "extra": 2}, "torchft": {}}, ["model"], None),
        ({"user": {}, "torchft": {}}, [], None),
        ({"user": {"model": 1}, "torchft": {}}, ["model", "optim"], "keys ['optim']"),
        ({"user": {"model": 1}}, ["model"], "'user'/'torchft' sections"),
        ({"torchft": {}}, [], "'user'/'torchft' sections"),
        ({"user": [1], "torchft": {}}, [], "'user'/'torchft' sections"),
        ([1, 2], [], "'user'/'torchft' sections"),
        (None, [], "'user'/'torchft' sections"),
    ],
)
def test_check_checkpoint(state: Any, required: List[str], error: Any) -> None:
    if error is None:
        check_checkpoint(state, required)
    else:
        with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
            check_checkpoint(state, required)


class _Transport:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.abandoned: List[Any] = []
        self.sent: List[Any] = []

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        if self.fail:
            raise ConnectionError("peer gone")
        self.sent.append((dst_ranks, step, state_dict))

    def abandon_checkpoint(self, step: int, reason: str) -> None:
        self.abandoned.append((step, reason))


def test_a_failed_send_abandons_the_step_so_receivers_fail_at_once() -> None:
    t = _Transport(fail=True)
    healer = Healer(t, timedelta(seconds=1))  # type: ignore[arg-type]
    q = QuorumResult(max_step=7, recover_dst_replica_ranks=[1, 2])
    with pytest.raises(ConnectionError):
        healer.send(q, lambda: {"user": {}, "torchft": {}}, timedelta(seconds=1))
    assert t.abandoned == [(7, "ConnectionError: peer gone")]


def test_send_is_a_no_op_without_receivers_and_reads_no_state() -> None:
    t = _Transport(fail=False)
    healer = Healer(t, timedelta(seconds=1))  # type: ignore[arg-type]

    def state():  # must not be called: reading the state takes the Manager's read lock
        raise AssertionError("state read without receivers")

    healer.send(QuorumResult(max_step=3), state, timedelta(seconds=1))
    healer.send(
        QuorumResult(max_step=3, recover_dst_replica_ranks=[2]),
        lambda: {"user": {}, "torchft": {}},
        timedelta(seconds=1),
    )
    assert t.sent == [([2], 3, {"user": {}, "torchft": {}})] and not t.abandoned


def test_receive_refuses_a_quorum_that_names_no_source() -> None:
    healer = Healer(_Transport(fail=False), timedelta(seconds=1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="names no source"):
        healer.receive(QuorumResult(quorum_id=4, heal=True), 0, timedelta(seconds=1), [])


def test_receive_asks_the_source_through_the_client_factory_by_torchft_s_name() -> None:
    # The Manager passes ft.manager.ManagerClient, so one substitution of that name (as torchft's
    # tests patch torchft.manager.ManagerClient) covers the heal source's client too.
    made: List[Any] = []

    class _Peer:
        def __init__(self, addr: str, connect_timeout: timedelta) -> None:
            made.append((addr, connect_timeout))
            self.asked: List[Any] = []

        def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
            self.asked.append((rank, timeout))
            return "meta"

        def close(self) -> None:
            pass

    class _Recv(_Transport):
        last_recv_path = "test"

        def recv_checkpoint(self, src_rank, metadata, step, timeout) -> Any:
            assert (src_rank, metadata, step) == (0, "meta", 9)
            return {"user": {"default": {}}, "torchft": {"step": 9}}

    healer = Healer(_Recv(fail=False), timedelta(seconds=3), client_factory=_Peer)  # type: ignore[arg-type]
    q = QuorumResult(
        heal=True, max_step=9, recover_src_replica_rank=0, recover_src_manager_address="src:1"
    )
    got = healer.receive(q, 2, timedelta(seconds=1), ["default"])
    assert got.metadata == "meta" and got.state["torchft"] == {"step": 9}
    assert made == [("src:1", timedelta(seconds=3))]
    assert healer._peer_clients["src:1"].asked == [(2, timedelta(seconds=1))]
    healer.close()


class _StripingTransport(_Transport):
    """What Healer.stripes() looks for: delivery confirmed, striped receive, wait_asked."""

    confirms_delivery = True

    def recv_checkpoint_striped(self, sources, step, timeout) -> Any:
        raise AssertionError("not called here")

    def wait_asked(self, step, receivers, timeout) -> bool:
        raise AssertionError("not called here")


_DONORS = [(0, "a:1"), (2, "c:1")]


# (name, quorum fields, transport stripes, stages)
SERVES = [
    ("assigned receivers", dict(replica_rank=0, recover_dst_replica_ranks=[1]), False, True),
    ("other donor, striping", dict(replica_rank=2, heal_donors=_DONORS), True, True),
    ("other donor, no striping", dict(replica_rank=2, heal_donors=_DONORS), False, False),
    ("single donor", dict(replica_rank=0, heal_donors=_DONORS[:1]), True, False),
    ("not a donor", dict(replica_rank=3, heal_donors=_DONORS), True, False),
    ("healing", dict(replica_rank=1, heal=True, heal_donors=_DONORS), True, False),
    ("nobody heals", dict(replica_rank=0), True, False),
]


@pytest.mark.parametrize("name, fields, stripes, stages", SERVES, ids=[c[0] for c in SERVES])
def test_who_stages_for_a_heal(name: str, fields: Any, stripes: bool, stages: bool) -> None:
    t = (_StripingTransport if stripes else _Transport)(fail=False)
    healer = Healer(t, timedelta(seconds=1))  # type: ignore[arg-type]
    q = QuorumResult(max_step=5, replica_world_size=4, **fields)
    assert healer.serves(q) is stages
    healer.send(q, lambda: {"user": {}, "torchft": {}}, timedelta(seconds=1))
    assert [s[:2] for s in t.sent] == ([(q.recover_dst_replica_ranks, 5)] if stages else [])
