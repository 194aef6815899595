"""HTTPTransport over real loopback HTTP, with senders in separate processes where it matters.

Receivers here use ``same_host=False`` so that every transfer takes the HTTP wire path (the
proxies and throttles below act on it); test_same_host.py covers the same-host path."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit
from datetime import timedelta
from typing import Any, List

import pytest

from ft.utils import net
from ft.utils.auth import InsecureServerError
import torch


from tests.checkpointing.ckpt_testlib import Peer, assert_same, check_payload, run_in_thread

from tests.corrupting_proxy import CorruptingProxy  # noqa: E402

from ft.checkpointing import (  # noqa: E402
    CheckpointAuthError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotAvailableError,
    CheckpointTransferError,
    HTTPTransport,
)
from ft.checkpointing.http_transport import default_advertise_host, plan_chunks  # noqa: E402

TO = timedelta(seconds=10)


def transport(**kw: Any) -> HTTPTransport:
    kw.setdefault("timeout", TO)
    kw.setdefault("num_chunks", 4)
    kw.setdefault("advertise_host", "127.0.0.1")
    kw.setdefault("same_host", False)
    return HTTPTransport(**kw)


class Slow(HTTPTransport):
    slow = 0.05

    def _pace(self) -> None:
        time.sleep(self.slow)


# ----------------------------------------------------------------------------- cross-process


def test_round_trip_separate_process_multi_dst_and_token(payload_path: str) -> None:
    peer = Peer(
        "http",
        "--step",
        "7",
        "--token",
        "s3cret-s3cret-s3cret-s3cret",
        "--chunks",
        "3",
        "--payload",
        payload_path,
    )
    receivers: List[HTTPTransport] = []
    try:
        url = peer.expect("ready")["url"]
        receivers = [transport(token="s3cret-s3cret-s3cret-s3cret", num_chunks=n) for n in (1, 3)]
        runs = [run_in_thread(lambda r=r: r.recv_checkpoint(0, url, 7, TO)) for r in receivers]
        for run in runs:
            run["thread"].join(20)
            assert "error" not in run, run.get("error")
            check_payload(run["value"])

        # a third destination later, with the default chunking
        check_payload(receivers[0].recv_checkpoint(0, url, 7, TO))

        # wrong token, no token -> 403 -> clear error
        with transport(token="wrong-wrong-wrong-wrong") as bad, transport(token=None) as none:
            with pytest.raises(CheckpointAuthError, match="403"):
                bad.recv_checkpoint(0, url, 7, TO)
            with pytest.raises(CheckpointAuthError, match="403"):
                none.recv_checkpoint(0, url, 7, TO)
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(f"{url}/ft/v1/checkpoint/7/meta", timeout=5)
        assert ei.value.code == 403

        # an older step than the staged one: not available, at once
        t0 = time.monotonic()
        with pytest.raises(CheckpointNotAvailableError, match="step 3"):
            receivers[0].recv_checkpoint(0, url, 3, TO)
        assert time.monotonic() - t0 < 2
    finally:
        for r in receivers:
            r.shutdown()
        peer.close()


def test_sender_killed_mid_transfer_fails_within_timeout() -> None:
    peer = Peer(
        "http", "--step", "1", "--plain", "--big-mb", "16", "--slow", "0.25", "--chunks", "4"
    )
    recv = transport(num_chunks=4)
    try:
        url = peer.expect("ready")["url"]
        run = run_in_thread(lambda: recv.recv_checkpoint(0, url, 1, timedelta(seconds=20)))
        time.sleep(1.0)  # meta done, data flowing (16 MiB at 4 x 4 MiB/s: ~4 s)
        assert run["thread"].is_alive()
        killed = time.monotonic()
        peer.kill9()
        run["thread"].join(15)
        assert not run["thread"].is_alive()
        assert isinstance(run.get("error"), CheckpointTransferError), run
        assert "vanished" in str(run["error"]) or "closed" in str(run["error"])
        print(f"http receiver failed {time.monotonic() - killed:.2f}s after kill -9")
        assert time.monotonic() - killed < 3
    finally:
        recv.shutdown()
        peer.close()


# ----------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("kind,offset", [("data", 12345), ("meta", 40)])
def test_corruption_in_transit_is_detected_and_not_returned(kind: str, offset: int) -> None:
    state = {"w": torch.randn(1 << 20), "meta": {"step": 3}}  # 4 MiB: several chunks
    with transport(num_chunks=3) as src, transport(num_chunks=3) as dst:
        src.send_checkpoint([1], 3, state, TO)
        port = urlsplit(src.metadata()).port
        proxy = CorruptingProxy(port, kind, offset)  # every matching response
        try:
            with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
                dst.recv_checkpoint(0, f"http://127.0.0.1:{proxy.port}", 3, TO)
            assert proxy.flipped >= 1
        finally:
            proxy.close()
        # the same transfer without the proxy is fine (the heal can be retried)
        got = dst.recv_checkpoint(0, src.metadata(), 3, TO)
        assert_same(state, got)


# ----------------------------------------------------------------------------- staging


def test_disallow_withdraws_and_restage_works() -> None:
    with transport() as src, transport() as dst:
        src.send_checkpoint([1], 5, {"a": torch.ones(3)}, TO)
        assert_same({"a": torch.ones(3)}, dst.recv_checkpoint(0, src.metadata(), 5, TO))
        src.disallow_checkpoint()
        t0 = time.monotonic()
        with pytest.raises(CheckpointNotAvailableError, match="410"):
            dst.recv_checkpoint(0, src.metadata(), 5, TO)
        assert time.monotonic() - t0 < 2
        src.send_checkpoint([1], 6, {"a": torch.zeros(2)}, TO)
        assert_same({"a": torch.zeros(2)}, dst.recv_checkpoint(0, src.metadata(), 6, TO))


def test_receiver_ahead_of_sender_waits_for_staging() -> None:
    with transport() as src, transport() as dst:
        run = run_in_thread(lambda: dst.recv_checkpoint(0, src.metadata(), 9, TO))
        time.sleep(0.3)
        src.send_checkpoint([1], 9, {"x": 1}, TO)
        run["thread"].join(10)
        assert run.get("value") == {"x": 1}, run
        # nothing ever staged for step 10: a clear error within the (short) timeout
        t0 = time.monotonic()
        with pytest.raises(CheckpointNotAvailableError, match="step 10"):
            dst.recv_checkpoint(0, src.metadata(), 10, timedelta(seconds=1))
        assert time.monotonic() - t0 < 2


def test_abandoned_step_fails_a_waiting_receiver_at_once() -> None:
    """A source that cannot build the state dict tells receivers so, instead of letting
    them wait out their timeout; staging a later step clears the mark."""
    with transport() as src, transport() as dst:
        run = run_in_thread(lambda: dst.recv_checkpoint(0, src.metadata(), 4, TO))
        time.sleep(0.3)  # the receiver is now waiting for step 4 to be staged
        src.abandon_checkpoint(4, "RuntimeError: state_dict failed")
        run["thread"].join(5)
        assert isinstance(run.get("error"), CheckpointNotAvailableError), run
        assert "failed to produce step 4: RuntimeError: state_dict failed" in str(run["error"])
        assert run["t"] < 0.3 + 2  # not the 10 s timeout
        src.send_checkpoint([1], 4, {"x": torch.ones(2)}, TO)  # a retry at the same step
        assert_same({"x": torch.ones(2)}, dst.recv_checkpoint(0, src.metadata(), 4, TO))


def test_an_announced_step_is_waited_for_even_after_it_was_withdrawn_or_abandoned() -> None:
    """A retry of the same step: the source announces it (expect_checkpoint) before it stages
    it again, so a receiver that asks in between waits instead of failing on the earlier
    attempt's withdrawal (410) or abandonment (409); abandoning it again still fails the
    receiver at once."""
    with transport() as src, transport() as dst:
        src.send_checkpoint([1], 5, {"a": torch.ones(3)}, TO)
        src.disallow_checkpoint()
        src.expect_checkpoint(5)
        run = run_in_thread(lambda: dst.recv_checkpoint(0, src.metadata(), 5, TO))
        time.sleep(0.3)
        assert "value" not in run and "error" not in run, run  # waiting, not refused
        src.send_checkpoint([1], 5, {"a": torch.full((3,), 2.0)}, TO)
        run["thread"].join(10)
        assert_same({"a": torch.full((3,), 2.0)}, run.get("value"))

        src.abandon_checkpoint(6, "the first attempt failed")
        src.expect_checkpoint(6)
        run = run_in_thread(lambda: dst.recv_checkpoint(0, src.metadata(), 6, TO))
        time.sleep(0.3)
        assert "value" not in run and "error" not in run, run
        src.abandon_checkpoint(6, "the retry failed too")
        run["thread"].join(5)
        assert "the retry failed too" in str(run.get("error")), run
        assert run["t"] < 0.3 + 2


def test_wait_delivered_counts_receivers_that_read_everything() -> None:
    state = {"w": torch.randn(1 << 18), "b": torch.ones(3)}
    with transport(num_chunks=2) as src, transport(num_chunks=2) as a, transport() as b:
        src.send_checkpoint([1, 2], 7, state, TO)
        assert src.wait_delivered(7, 1, timedelta(seconds=0.2)) is False  # nobody read yet
        assert_same(state, a.recv_checkpoint(0, src.metadata(), 7, TO))
        assert src.wait_delivered(7, 2, timedelta(seconds=0.2)) is False  # one of two
        assert_same(state, b.recv_checkpoint(0, src.metadata(), 7, TO))
        assert src.wait_delivered(7, 2, timedelta(seconds=5)) is True
        assert src.wait_delivered(8, 1, timedelta(seconds=0.2)) is False  # not staged
        src.disallow_checkpoint()
        assert src.wait_delivered(7, 2, timedelta(seconds=0.2)) is False  # withdrawn


def test_a_released_checkpoint_serves_nobody_new_until_staged_again() -> None:
    """Once wait_delivered released a step (its receivers have it; the caller trains on and
    changes its tensors), a receiver asking for the same step again (a second heal at an
    unchanged step) is not served the changing tensors: it waits for the step to be staged
    afresh and gets the new state; if it is not staged again, it is told so."""
    old, new = {"w": torch.full((1 << 16,), 1.0)}, {"w": torch.full((1 << 16,), 2.0)}
    with transport() as src, transport() as a, transport() as b:
        src.send_checkpoint([1], 0, old, TO)
        assert_same(old, a.recv_checkpoint(0, src.metadata(), 0, TO))
        assert src.wait_delivered(0, 1, TO) is True
        run = run_in_thread(lambda: b.recv_checkpoint(0, src.metadata(), 0, TO))
        time.sleep(0.3)
        assert "value" not in run and "error" not in run, run  # waiting, not served
        src.send_checkpoint([1], 0, new, TO)
        run["thread"].join(10)
        assert "error" not in run, run
        assert_same(new, run.get("value"))

        assert src.wait_delivered(0, 1, TO) is True
        with pytest.raises(CheckpointNotAvailableError, match="delivered and released"):
            b.recv_checkpoint(0, src.metadata(), 0, timedelta(seconds=1))


def test_disallow_waits_for_transfers_in_flight() -> None:
    state = {"w": torch.randn(1 << 20)}  # 4 MiB, 2 chunks, 0.1 s per MiB slice
    src = Slow(TO, 2, advertise_host="127.0.0.1")
    src.slow = 0.1
    try:
        with transport(num_chunks=2) as dst:
            src.send_checkpoint([1], 1, state, TO)
            run = run_in_thread(lambda: dst.recv_checkpoint(0, src.metadata(), 1, TO))
            deadline = time.monotonic() + 5
            while src._staging is not None and not src._staging.active:  # noqa: SLF001
                assert time.monotonic() < deadline
                time.sleep(0.01)
            t0 = time.monotonic()
            src.disallow_checkpoint()  # must not return before the transfer is done
            waited = time.monotonic() - t0
            run["thread"].join(5)
            assert waited > 0.05
            assert "error" not in run, run.get("error")
            assert_same(state, run["value"])
    finally:
        src.shutdown()


def test_disallow_cuts_off_a_stuck_transfer_after_timeout() -> None:
    state = {"w": torch.randn(1 << 21)}  # 8 MiB, 1 chunk: 8 slices x 0.5 s
    src = Slow(timedelta(seconds=0.6), 1, advertise_host="127.0.0.1")
    src.slow = 0.5
    try:
        with transport(num_chunks=1) as dst:
            src.send_checkpoint([1], 1, state, TO)
            run = run_in_thread(lambda: dst.recv_checkpoint(0, src.metadata(), 1, TO))
            time.sleep(0.3)
            t0 = time.monotonic()
            src.disallow_checkpoint()
            assert time.monotonic() - t0 < 2.0
            run["thread"].join(5)
            assert isinstance(run.get("error"), CheckpointError), run
    finally:
        src.shutdown()


def test_unsupported_leaf_raises_type_error_naming_the_path() -> None:
    with transport() as src:
        src.send_checkpoint([1], 1, {"ok": 1}, TO)
        with pytest.raises(TypeError, match=r"\['user'\]\['opt'\]\[3\].*object"):
            src.send_checkpoint([1], 2, {"user": {"opt": [1, 2, 3, object()]}}, TO)
        with pytest.raises(TypeError, match="dict key"):
            src.send_checkpoint([1], 2, {frozenset(): 1}, TO)
        # the earlier checkpoint is still served
        with transport() as dst:
            assert dst.recv_checkpoint(0, src.metadata(), 1, TO) == {"ok": 1}


def test_empty_and_tensorless_state_dicts() -> None:
    with transport() as src, transport() as dst:
        for i, sd in enumerate([{}, {"a": [1, "x"]}, {"e": torch.empty(0)}]):
            src.send_checkpoint([1], i, sd, TO)
            assert_same(sd, dst.recv_checkpoint(0, src.metadata(), i, TO))


def test_shutdown_is_bounded_with_idle_and_stuck_clients() -> None:
    src = transport(timeout=timedelta(seconds=30))
    src.send_checkpoint([1], 1, {"w": torch.ones(10)}, TO)
    port = urlsplit(src.metadata()).port
    idle = socket.create_connection(("127.0.0.1", port), timeout=5)  # sends nothing
    try:
        time.sleep(0.1)
        t0 = time.monotonic()
        src.shutdown()
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(CheckpointError):
            with transport() as dst:
                dst.recv_checkpoint(0, src.metadata(), 1, timedelta(seconds=1))
    finally:
        idle.close()


def test_timeout_against_a_silent_server() -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        with transport() as dst:
            t0 = time.monotonic()
            with pytest.raises(CheckpointTransferError, match="timed out"):
                dst.recv_checkpoint(
                    0, f"http://127.0.0.1:{silent.getsockname()[1]}", 1, timedelta(seconds=0.5)
                )
            assert time.monotonic() - t0 < 1.5
    finally:
        silent.close()


def test_errors_are_also_what_torchft_callers_catch() -> None:
    """torchft's HTTP transport fetches with urlopen, so its callers catch urllib's errors
    (or OSError): ft's errors are those too, and still ft's own."""
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    with transport() as src, transport() as dst:
        with pytest.raises(urllib.error.URLError) as e:
            dst.recv_checkpoint(0, f"http://127.0.0.1:{port}", 1, timedelta(seconds=2))
        assert isinstance(e.value, CheckpointTransferError)
        assert isinstance(e.value, CheckpointError) and isinstance(e.value, OSError)
        assert str(e.value) and "urlopen error" not in str(e.value)

        src.send_checkpoint([1], 5, {"a": torch.ones(3)}, TO)
        with pytest.raises(urllib.error.HTTPError) as h:
            dst.recv_checkpoint(0, src.metadata(), 10, timedelta(seconds=1))  # a missing step
        assert isinstance(h.value, CheckpointNotAvailableError)
        assert isinstance(h.value, CheckpointError) and isinstance(h.value, urllib.error.URLError)
        assert h.value.code in (404, 409, 410) and "step 10" in str(h.value)
    # the constructors keep their one-message form, and pickling (to another process) works
    import pickle

    for err in (CheckpointTransferError("x"), CheckpointNotAvailableError("y")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)


def test_token_and_advertise_host_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_CHECKPOINT_TOKEN", "envtok-envtok-envtok")
    monkeypatch.setenv("FT_ADVERTISE_HOST", "127.0.0.1")
    with HTTPTransport(TO, 2) as src, HTTPTransport(TO, 2) as dst:
        assert src.metadata().startswith("http://127.0.0.1:")
        src.send_checkpoint([1], 1, {"a": 1}, TO)
        assert dst.recv_checkpoint(0, src.metadata(), 1, TO) == {"a": 1}
        with transport(token="other-other-other-other") as bad:
            with pytest.raises(CheckpointAuthError):
                bad.recv_checkpoint(0, src.metadata(), 1, TO)


def test_default_advertise_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FT_ADVERTISE_HOST", raising=False)
    host = default_advertise_host()
    assert host and host not in ("0.0.0.0", "::")
    assert default_advertise_host("127.0.0.1") == "127.0.0.1"
    # the default is something this host can actually be reached at; beyond loopback it
    # serves only with a job secret (or in insecure mode)
    if not net.is_loopback(host):
        with pytest.raises(InsecureServerError, match="FT_JOB_SECRET"):
            HTTPTransport(TO, 1)
    secret = "default-host-secret-0123456789"
    with HTTPTransport(TO, 1, secret=secret) as src, transport(token=secret) as dst:
        assert src.metadata().startswith(f"http://{host}:")
        src.send_checkpoint([1], 1, {"a": 2}, TO)
        assert dst.recv_checkpoint(0, src.metadata(), 1, TO) == {"a": 2}


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_ipv6_metadata_is_bracketed() -> None:
    try:
        src = HTTPTransport(TO, 1, advertise_host="::1", bind_host="::1")
    except OSError:
        pytest.skip("IPv6 loopback unavailable")
    with src, transport() as dst:
        assert src.metadata().startswith("http://[::1]:")
        src.send_checkpoint([1], 1, {"a": 3}, TO)
        assert dst.recv_checkpoint(0, src.metadata(), 1, TO) == {"a": 3}


def test_plan_chunks() -> None:
    assert plan_chunks(0, 4) == []
    assert plan_chunks(10, 4) == [(0, 10)]
    r = plan_chunks((16 << 20) + 3, 4)
    assert len(r) == 4 and r[0][0] == 0 and r[-1][1] == (16 << 20) + 3
    assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
