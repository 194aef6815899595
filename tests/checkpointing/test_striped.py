"""Striped heal on loopback (HTTPTransport.recv_checkpoint_striped): donors are real processes
(tests/checkpointing/ckpt_peer.py) serving the same deterministic payload; the receiver is this
process. Speed is measured by bench/heal_bench.py, not here."""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from ft.checkpointing import CheckpointCorruptError, CheckpointTransferError, HTTPTransport
from ft.checkpointing.striped import StripeOptions
from tests.checkpointing.ckpt_testlib import Peer, check_payload, run_in_thread

STEP = 3
BIG_MB = 8
TIMEOUT = timedelta(seconds=30)
PAYLOAD = ("--big-mb", str(BIG_MB), "--chunks", "2")  # what a donor serves (ckpt_peer.py)


def _receiver(**stripe: Any) -> HTTPTransport:
    return HTTPTransport(
        TIMEOUT, 2, advertise_host="127.0.0.1", same_host=False, stripe=StripeOptions(**stripe)
    )


@contextlib.contextmanager
def _striped_heal(
    n: int, *peer_args: str, **stripe: Any
) -> Iterator[Tuple[List[Peer], List[str], HTTPTransport]]:
    """``n`` donor processes serving step STEP (``peer_args``: ckpt_peer.py's options) and a
    striped receiver (``stripe``: its StripeOptions), as (donors, their urls, receiver); all
    shut down on exit."""
    peers: List[Peer] = []
    rx = _receiver(**stripe)
    try:
        peers.extend(Peer("http", "--step", str(STEP), *peer_args) for _ in range(n))
        urls = [p.expect("ready", timeout=60)["url"] for p in peers]
        yield peers, urls, rx
    finally:
        rx.shutdown()
        for p in peers:
            p.close()


def _heal(rx: HTTPTransport, urls: List[str]) -> Dict[str, Any]:
    """The striped heal from ``urls``, on a thread of its own (``run_in_thread``'s dict)."""
    return run_in_thread(lambda: rx.recv_checkpoint_striped(list(enumerate(urls)), STEP, TIMEOUT))


def _wait(out: Dict[str, Any]) -> None:
    out["thread"].join(TIMEOUT.total_seconds())
    assert not out["thread"].is_alive()


def test_three_donors_bitwise_and_each_serves_part():
    # paced donors (50 ms per 1 MiB range): no donor finishes before the others have begun
    with _striped_heal(3, *PAYLOAD, "--slow", "0.05") as (_, urls, rx):
        got = rx.recv_checkpoint_striped(list(enumerate(urls)), STEP, TIMEOUT)
        check_payload(got, BIG_MB)
        served = rx.last_served
        assert set(served) == set(urls) and all(v > 0 for v in served.values()), served


def test_donor_killed_mid_heal_the_others_finish_bitwise():
    # paced donors (20 ms per 1 MiB slice): the heal takes long enough to kill one mid-way
    with _striped_heal(3, *PAYLOAD, "--slow", "0.02", stall_timeout_s=2.0) as (peers, urls, rx):
        out = _heal(rx, urls)
        time.sleep(0.15)
        peers[1].kill9()
        _wait(out)
        assert "error" not in out, out.get("error")
        check_payload(out["value"], BIG_MB)
        assert rx.last_served[urls[1]] < sum(rx.last_served.values())


def test_every_donor_gone_is_a_clear_error():
    with _striped_heal(2, *PAYLOAD, "--slow", "0.05", stall_timeout_s=1.0) as (peers, urls, rx):
        out = _heal(rx, urls)
        time.sleep(0.15)
        for p in peers:
            p.kill9()
        _wait(out)
        err = out.get("error")
        assert isinstance(err, CheckpointTransferError), err
        assert "no source left" in str(err) and all(u in str(err) for u in urls), err


def test_donors_with_different_bytes_fail_the_heal():
    # --plain: a random tensor of its own in each donor, same shape: the digests disagree
    with _striped_heal(2, "--plain", "--big-mb", "4") as (_, urls, rx):
        with pytest.raises(CheckpointCorruptError, match="different bytes"):
            rx.recv_checkpoint_striped(list(enumerate(urls)), STEP, TIMEOUT)


@contextlib.contextmanager
def _two_sources() -> Iterator[Tuple[Dict[str, Any], HTTPTransport, HTTPTransport, HTTPTransport]]:
    """A 4 MiB state, two sources in this process (not yet serving it) and a striped receiver;
    all shut down on exit."""
    import torch

    state = {"user": {"w": torch.arange(4 << 18, dtype=torch.float32)}, "torchft": {"step": 1}}
    a = HTTPTransport(TIMEOUT, 2, advertise_host="127.0.0.1", same_host=False)
    b = HTTPTransport(TIMEOUT, 2, advertise_host="127.0.0.1", same_host=False)
    rx = _receiver()
    try:
        yield state, a, b, rx
    finally:
        for t in (a, b, rx):
            t.shutdown()


def test_sources_count_only_their_own_receiver_and_wait_for_helpers():
    """The assigned source counts the striped receiver's delivery; a helper does not, but its
    wait for its own receivers lasts until the striped reader is done."""
    import torch

    with _two_sources() as (state, a, b, rx):
        for t in (a, b):
            t.send_checkpoint([1], STEP, state, TIMEOUT)
        got = rx.recv_checkpoint_striped([(0, a.metadata()), (1, b.metadata())], STEP, TIMEOUT)
        assert torch.equal(got["user"]["w"], state["user"]["w"])
        # Every byte came from one of the two (which one served how much is up to timing: a
        # loaded machine may let one source take every range before the other answers).
        nbytes = state["user"]["w"].numel() * 4
        assert rx.last_served[a.metadata()] + rx.last_served[b.metadata()] == nbytes, rx.last_served
        assert a.wait_delivered(STEP, 1, timedelta(seconds=5))
        assert not b.wait_delivered(STEP, 1, timedelta(seconds=0.2))
        # once a source's receivers have it (it may change the tensors from then on), no new
        # striped reader is let in: a later heal helped by it takes everything elsewhere
        got = rx.recv_checkpoint_striped([(1, b.metadata()), (0, a.metadata())], STEP, TIMEOUT)
        assert torch.equal(got["user"]["w"], state["user"]["w"])
        assert rx.last_served[a.metadata()] == 0, rx.last_served


def test_a_helping_source_waits_until_its_receivers_have_asked():
    """wait_asked: a donor without receivers of its own learns that the striped receivers
    came (each metadata answer counts), and stops waiting once it released the state."""
    import torch

    with _two_sources() as (state, a, b, rx):
        for t in (a, b):
            t.send_checkpoint([], STEP, state, TIMEOUT)
        assert not b.wait_asked(STEP, 1, timedelta(seconds=0.2))  # nobody came yet
        got = rx.recv_checkpoint_striped([(0, a.metadata()), (1, b.metadata())], STEP, TIMEOUT)
        assert torch.equal(got["user"]["w"], state["user"]["w"])
        assert b.wait_asked(STEP, 1, timedelta(seconds=5))
        assert not b.wait_asked(STEP, 2, timedelta(seconds=0.2))  # one receiver, not two
        assert b.wait_delivered(STEP, 0, timedelta(seconds=5))  # no striped reader left
        assert b.wait_asked(STEP, 2, timedelta(seconds=5))  # released: nobody new may come
