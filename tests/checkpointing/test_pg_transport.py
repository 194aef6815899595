"""PGTransport over torch's own Gloo process groups (TCPStore on loopback)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist


from tests.checkpointing.ckpt_testlib import Peer, assert_same, check_payload, gloo_pg

from tests.procs import in_threads, values  # noqa: E402
from ft.checkpointing import (  # noqa: E402
    CheckpointCorruptError,
    CheckpointNotAvailableError,
    CheckpointTransferError,
    PGTransport,
)

TO = timedelta(seconds=10)
CPU = torch.device("cpu")


def master_store(world: int) -> Any:
    return dist.TCPStore("127.0.0.1", 0, world, True, timeout=TO, wait_for_workers=False)


def make_pgs(store: Any, ranks: List[int], world: int, timeout: timedelta = TO) -> Dict[int, Any]:
    """Creates Gloo PGs for ``ranks`` of a group concurrently (construction is collective)."""

    def make(rank: int) -> Any:
        client = dist.TCPStore("127.0.0.1", store.port, world, False, timeout=TO)
        return gloo_pg(client, rank, world, timeout)

    return dict(zip(ranks, values(in_threads([lambda r=r: make(r) for r in ranks]))))


def test_round_trip_separate_process_two_destinations(payload_path: str) -> None:
    store = master_store(3)
    peer = Peer(
        "pg",
        "--port",
        str(store.port),
        "--world",
        "3",
        "--dsts",
        "1,2",
        "--step",
        "7",
        "--payload",
        payload_path,
    )
    try:
        pgs = make_pgs(store, [1, 2], 3)
        transports = [PGTransport(pgs[r], TO, CPU) for r in (1, 2)]
        outs = in_threads([lambda t=t: t.recv_checkpoint(0, "<n/a>", 7, TO) for t in transports])
        peer.expect("sent")
        for out in outs:
            assert "error" not in out, out.get("error")
            check_payload(out["value"])
            assert out["value"]["user"]["misc"]["tied_a"].device == CPU
    finally:
        peer.close()


def test_sender_killed_mid_transfer_fails_within_timeout() -> None:
    store = master_store(2)
    peer = Peer(
        "pg",
        "--port",
        str(store.port),
        "--world",
        "2",
        "--dsts",
        "1",
        "--step",
        "1",
        "--plain",
        "--big-mb",
        "4",
        "--slow",
        "0.6",
    )
    try:
        pg = make_pgs(store, [1], 2, timeout=timedelta(seconds=20))[1]
        peer.expect("connected")
        tr = PGTransport(pg, timedelta(seconds=20), CPU)
        result: Dict[str, Any] = {}

        def recv() -> None:
            try:
                result["value"] = tr.recv_checkpoint(0, "<n/a>", 1, timedelta(seconds=20))
            except BaseException as e:  # noqa: BLE001
                result["error"] = e

        th = threading.Thread(target=recv, daemon=True)
        th.start()
        time.sleep(1.0)  # preamble arrived (0.6 s), header/tensor still pending
        assert th.is_alive()
        killed = time.monotonic()
        peer.kill9()
        th.join(15)
        assert not th.is_alive()
        assert isinstance(result.get("error"), CheckpointTransferError), result
        assert "rank 0" in str(result["error"])
        print(f"pg receiver failed {time.monotonic() - killed:.2f}s after kill -9")
        assert time.monotonic() - killed < 3
    finally:
        peer.close()


class CorruptingPG:
    """Wraps a PG; flips one byte of the n-th received buffer after it arrives (in flight)."""

    def __init__(self, pg: Any, nth: int) -> None:
        self.pg = pg
        self.nth = nth
        self.count = 0

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int) -> Any:
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int) -> Any:
        work = self.pg.recv(tensors, src, tag)
        self.count += 1
        if self.count != self.nth:
            return work
        outer = self

        class Work:
            def wait(self, timeout: timedelta = timedelta(0)) -> bool:
                ok = work.wait(timeout)
                flat = tensors[0].view(torch.uint8).reshape(-1)
                flat[flat.numel() // 2] ^= 0x01
                outer.corrupted = True
                return ok

        return Work()


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    store = master_store(2)
    pgs = make_pgs(store, [0, 1], 2, timeout=timedelta(seconds=5))
    yield pgs
    for pg in pgs.values():
        try:
            pg.shutdown()
        except Exception:  # noqa: BLE001
            pass


# receives: 1 preamble, 2 header, 3-5 tensors, 6 checksum trailer
@pytest.mark.parametrize("nth", [2, 4, 6])
def test_corruption_in_flight_is_detected(pair: Dict[int, Any], nth: int) -> None:
    state = {"a": torch.randn(100), "b": torch.arange(1000), "c": torch.ones(3, 3)}
    send = PGTransport(pair[0], TO, CPU)
    bad = CorruptingPG(pair[1], nth)
    recv = PGTransport(bad, TO, CPU)
    outs = in_threads(
        [
            lambda: send.send_checkpoint([1], 3, state, TO),
            lambda: recv.recv_checkpoint(0, "<n/a>", 3, TO),
        ]
    )
    if nth == 2:  # a corrupt header is refused: the sender fails fast and clearly
        assert "refused" in str(outs[0].get("error")) and outs[0]["t"] < 3, outs[0]
    else:  # tensor corruption is only seen by the receiver
        assert "error" not in outs[0], outs[0]
    assert isinstance(outs[1].get("error"), CheckpointCorruptError), outs[1]
    assert "value" not in outs[1]
    assert "checksum" in str(outs[1]["error"])


def test_step_mismatch_and_inplace_template(pair: Dict[int, Any]) -> None:
    state = {"model": {"w": torch.randn(4, 5), "b": torch.randn(5)}, "step": 3, "n": [1.5]}
    template = {"model": {"w": torch.zeros(4, 5), "b": torch.zeros(5)}, "step": 0, "n": [0.0]}
    send = PGTransport(pair[0], TO, CPU)
    recv = PGTransport(pair[1], TO, CPU, state_dict=lambda: template)
    outs = in_threads(
        [
            lambda: send.send_checkpoint([1], 3, state, TO),
            lambda: recv.recv_checkpoint(0, "<n/a>", 3, TO),
        ]
    )
    assert "error" not in outs[0] and "error" not in outs[1], outs
    got = outs[1]["value"]
    assert_same(state, got)
    # received straight into the template's storage
    assert got["model"]["w"].data_ptr() == template["model"]["w"].data_ptr()
    assert torch.equal(template["model"]["b"], state["model"]["b"])

    outs = in_threads(
        [
            lambda: send.send_checkpoint([1], 4, state, TO),
            lambda: recv.recv_checkpoint(0, "<n/a>", 5, TO),
        ]
    )
    assert isinstance(outs[1].get("error"), CheckpointNotAvailableError), outs[1]
    assert "step 4" in str(outs[1]["error"])
    # the sender hears of the refusal at once instead of waiting out its timeout
    assert isinstance(outs[0].get("error"), CheckpointTransferError), outs[0]
    assert "refused" in str(outs[0]["error"]) and outs[0]["t"] < 3
    # and the channel is still in sync: the next transfer works
    outs = in_threads(
        [
            lambda: send.send_checkpoint([1], 6, state, TO),
            lambda: recv.recv_checkpoint(0, "<n/a>", 6, TO),
        ]
    )
    assert "error" not in outs[0] and "error" not in outs[1], outs
    assert_same(state, outs[1]["value"])


def test_recv_without_sender_times_out(pair: Dict[int, Any]) -> None:
    recv = PGTransport(pair[1], TO, CPU)
    t0 = time.monotonic()
    with pytest.raises(CheckpointTransferError):
        recv.recv_checkpoint(0, "<n/a>", 1, timedelta(seconds=0.5))
    assert time.monotonic() - t0 < 3


def test_timeout_defaults_to_the_transports_own(pair: Dict[int, Any]) -> None:
    # As in torchft-nightly: send/recv_checkpoint take the constructor's timeout when given
    # none. A transfer then completes, and a receive with no sender ends at that timeout.
    state = {"w": torch.randn(3, 2), "step": 2}
    send = PGTransport(pair[0], TO, CPU)
    recv = PGTransport(pair[1], TO, CPU)
    outs = in_threads(
        [
            lambda: send.send_checkpoint([1], 2, state),
            lambda: recv.recv_checkpoint(0, "<n/a>", 2),
        ]
    )
    assert "error" not in outs[0] and "error" not in outs[1], outs
    assert_same(state, outs[1]["value"])
    short = PGTransport(pair[1], timedelta(seconds=0.5), CPU)
    t0 = time.monotonic()
    with pytest.raises(CheckpointTransferError):
        short.recv_checkpoint(0, "<n/a>", 3)
    assert time.monotonic() - t0 < 3  # the constructor's 0.5 s, not a default of its own


def test_unsupported_leaf_raises_type_error(pair: Dict[int, Any]) -> None:
    send = PGTransport(pair[0], TO, CPU)
    with pytest.raises(TypeError, match=r"\['x'\]\['f'\].*function"):
        send.send_checkpoint([1], 1, {"x": {"f": lambda: 0}}, TO)
    assert send.metadata() == "<n/a>"


def test_hostile_preamble_declaring_a_huge_header_is_refused_before_allocating(
    pair: Dict[int, Any],
) -> None:
    import struct

    from ft.checkpointing import pg_transport, serialization as ser

    hlen = ser.MAX_HEADER_BYTES + 1  # one byte over what any manifest may need
    words = [pg_transport.MAGIC, 3, hlen, 0]
    words.append(ser.crc32(struct.pack("<4q", *words)))
    recv = PGTransport(pair[1], TO, CPU)

    def hostile_send() -> list:
        pair[0].send([torch.tensor(words, dtype=torch.int64)], 1, 0).wait()
        ack = torch.zeros(2, dtype=torch.int64)  # the receiver's refusal, as a sender reads it
        pair[0].recv([ack], 1, 0).wait()
        return ack.tolist()

    outs = in_threads([hostile_send, lambda: recv.recv_checkpoint(0, "<n/a>", 3, TO)])
    assert isinstance(outs[1].get("error"), CheckpointCorruptError), outs[1]
    assert "bad preamble" in str(outs[1]["error"])
    assert outs[1]["t"] < 3, outs[1]
    assert outs[0]["value"] == [pg_transport.ACK_MAGIC, 1], outs[0]


def test_source_refuses_a_header_no_receiver_would_accept() -> None:
    from ft.checkpointing import serialization as ser

    with pytest.raises(ValueError, match="receivers accept at most"):
        ser.check_header_size(b"x" * (ser.MAX_HEADER_BYTES + 1), 7)
    ser.check_header_size(b"x" * 100, 7)
