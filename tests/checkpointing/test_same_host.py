"""The same-host path of HTTPTransport (ft/checkpointing/same_host.py): a receiver on the
source's host copies the tensors out of the source process with process_vm_readv and checks
every byte against the source's CRC-32C. Sources run in separate processes where the claim
is about processes (kill -9, another process's memory)."""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List

import pytest
import torch


from tests.checkpointing.ckpt_testlib import Peer, assert_same, check_payload, run_in_thread

from ft.checkpointing import (  # noqa: E402
    CheckpointAuthError,
    CheckpointCorruptError,
    CheckpointNotAvailableError,
    CheckpointTransferError,
    HTTPTransport,
    same_host,
)
from ft.checkpointing import http_protocol, same_host_source  # noqa: E402
from ft.checkpointing import serialization as ser  # noqa: E402
from ft.checkpointing.served import ServedCheckpoint  # noqa: E402
from ft.checkpointing.same_host_source import SameHostSource  # noqa: E402
from ft.checkpointing.staging import Staging  # noqa: E402
from ft.utils.auth import SAME_HOST_PURPOSE, JobSecret, Signer  # noqa: E402
from ft.utils.deadline import Deadline  # noqa: E402

pytestmark = pytest.mark.skipif(not same_host.supported(), reason="Linux only")

TO = timedelta(seconds=10)


def transport(**kw: Any) -> HTTPTransport:
    kw.setdefault("timeout", TO)
    kw.setdefault("num_chunks", 4)
    kw.setdefault("advertise_host", "127.0.0.1")
    return HTTPTransport(**kw)


def healed(dst: HTTPTransport, src: HTTPTransport, step: int, state: Any, path: str) -> Any:
    """Heals ``dst`` from ``src`` at ``step``: the state arrives bitwise equal to ``state``, by
    ``path`` ("same-host" or "http"). Returns it."""
    got = dst.recv_checkpoint(0, src.metadata(), step, TO)
    assert dst.last_recv_path == path
    assert_same(state, got)
    return got


def test_round_trip_from_another_process_is_bitwise_and_skips_the_socket(
    payload_path: str,
) -> None:
    peer = Peer(
        "http", "--step", "4", "--token", "tok-tok-tok-tok-tok-tok", "--payload", payload_path
    )
    try:
        url = peer.expect("ready")["url"]
        with transport(token="tok-tok-tok-tok-tok-tok") as rx:
            got = rx.recv_checkpoint(0, url, 4, TO)
            assert rx.last_recv_path == "same-host"
            check_payload(got)
            again = rx.recv_checkpoint(0, url, 4, TO)  # the source serves it again
            assert_same(got, again)
        with transport(token="tok-tok-tok-tok-tok-tok", same_host=False) as rx:
            assert_same(got, rx.recv_checkpoint(0, url, 4, TO))
            assert rx.last_recv_path == "http"
    finally:
        peer.close()


def test_large_tensors_are_received_into_their_own_huge_page_advised_mappings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: List[Any] = []
    real = ser._allocate_huge_pages

    def spy(spec: Any) -> Any:
        t = real(spec)
        made.append(t)
        return t

    monkeypatch.setattr(ser, "_allocate_huge_pages", spy)
    state = {"big": torch.randn(3 << 20), "small": torch.arange(5)}
    with transport() as src, transport() as dst:
        src.send_checkpoint([1], 1, state, TO)
        got = healed(dst, src, 1, state, "same-host")
        # only tensors >= 2 MiB: the receiver's, and the source's host copy (same process)
        assert 1 <= len(made) <= 2 and all(m is not None for m in made)
        assert got["big"].data_ptr() in [m.data_ptr() for m in made]
        assert not got["big"].untyped_storage().resizable()  # a mapping of its own, not heap
        got["big"].add_(1)  # writable, an ordinary tensor otherwise
        assert torch.equal(got["big"], state["big"] + 1)


def test_source_serves_large_cpu_tensors_from_a_huge_page_copy_within_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """send_checkpoint copies CPU tensors >= 2 MiB into huge-page memory on a background
    thread, so the receiver's kernel copy reads huge pages; small tensors and checkpoints over
    the memory budget are served from the caller's tensors. Either way the bytes match."""
    state = {"big": torch.randn(1 << 20), "small": torch.randn(10)}
    with transport() as src, transport() as dst:
        src.send_checkpoint([1], 1, state, TO)
        st = src._staging
        assert st is not None
        end = time.monotonic() + 5
        while st.cpu(0).data_ptr() == state["big"].data_ptr() and time.monotonic() < end:
            time.sleep(0.005)
        copy = st.cpu(0)
        assert copy.data_ptr() != state["big"].data_ptr()
        assert not copy.untyped_storage().resizable()  # an mmap of its own (huge-page advised)
        assert torch.equal(copy, state["big"])
        assert st.cpu(1).data_ptr() == state["small"].data_ptr()
        healed(dst, src, 1, state, "same-host")

        monkeypatch.setattr(same_host_source, "host_copy_budget", lambda: 1 << 20)
        src.send_checkpoint([1], 2, state, TO)
        st = src._staging
        assert st is not None
        time.sleep(0.2)
        assert st.cpu(0).data_ptr() == state["big"].data_ptr()  # over budget: served in place
        assert_same(state, dst.recv_checkpoint(0, src.metadata(), 2, TO))


def test_source_checksums_each_range_once_ahead_of_the_receiver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """send_checkpoint checksums the same-host ranges on a background thread; receivers (two
    here, one after the other) get those checksums instead of recomputing them."""
    calls: List[Any] = []
    real_checksum = Staging.checksum

    def counting(st: Staging, start: int, end: int) -> int:
        calls.append((start, end))
        return real_checksum(st, start, end)

    monkeypatch.setattr(Staging, "checksum", counting)
    state = {"w": torch.randn(3 << 20), "v": torch.randn(7)}  # 12 MiB: ranges of ~1 MiB
    src = HTTPTransport(TO, 4, advertise_host="127.0.0.1")
    try:
        with transport() as dst:
            src.send_checkpoint([1], 5, state, TO)
            st = src._staging
            assert st is not None and len(st.local_ranges) > 8
            end = time.monotonic() + 5
            while not st.prepared() and time.monotonic() < end:
                time.sleep(0.005)
            assert st.prepared()
            for _ in range(2):
                healed(dst, src, 5, state, "same-host")
            assert sorted(calls) == sorted(st.local_ranges)  # each range exactly once
    finally:
        src.shutdown()


def test_disallow_stops_and_waits_for_the_background_preparation() -> None:
    """After disallow_checkpoint returns the caller may change its tensors: the background
    preparation (host copy, checksums) must have stopped reading them by then, promptly."""

    class Paced(HTTPTransport):
        def _pace(self) -> None:
            time.sleep(0.05)  # 1 MiB slices: 8 MiB take 0.4 s to checksum

    state = {"w": torch.randn(2 << 20)}
    src = Paced(TO, 4, advertise_host="127.0.0.1")
    try:
        src.send_checkpoint([1], 1, state, TO)
        st = src._staging
        assert st is not None and st.preparer is not None
        time.sleep(0.1)
        assert st.preparer.is_alive()  # still checksumming
        t0 = time.monotonic()
        src.disallow_checkpoint()
        assert time.monotonic() - t0 < 1.0
        assert not st.preparer.is_alive()
        assert not st.prepared()  # it stopped early, not by finishing
    finally:
        src.shutdown()


def test_corrupted_copy_is_detected_not_returned_and_the_retry_succeeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = {"w": torch.randn(1 << 20), "n": 3}
    real_copy = same_host._copy_ranges
    flipped = []

    def corrupting_copy(pid: int, plan: Any) -> Any:
        """The copy lands one wrong byte; the receiver's checksums are of what landed."""
        crcs, err = real_copy(pid, plan)
        if not flipped:
            plan[0][0][1][100] ^= 0x5A
            flipped.append(plan[0][0][0])
            crcs = []
            for pieces in plan:
                crc = 0
                for _, buf in pieces:
                    crc = ser.crc32c(buf, crc)
                crcs.append(crc)
        return crcs, err

    with transport() as src, transport() as dst:
        src.send_checkpoint([1], 2, state, TO)
        monkeypatch.setattr(same_host, "_copy_ranges", corrupting_copy)
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch.*same-host"):
            dst.recv_checkpoint(0, src.metadata(), 2, TO)
        assert flipped
        healed(dst, src, 2, state, "same-host")  # the heal can be retried


def test_kernel_refusal_falls_back_to_http_with_the_same_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where process_vm_readv is not permitted (a sandbox, a hardened kernel) the receiver uses
    HTTP; the source keeps serving (the fallback does not drop the receiver's lease)."""

    def refusing_copy(pid: int, plan: Any) -> Any:
        return [], errno.EPERM  # what process_vm_readv answers under a hardened kernel

    class Paced(HTTPTransport):
        """Slow checksums: the receiver's fallback answer arrives while the source is busy."""

        releases: List[Any] = []

        def _pace(self) -> None:
            time.sleep(0.05)

    real_release = ServedCheckpoint.release

    def recording_release(server: Any, st: Any, lease_id: str, conn: Any, used: Any) -> None:
        Paced.releases.append((type(conn).__name__, used))
        real_release(server, st, lease_id, conn, used)

    monkeypatch.setattr(ServedCheckpoint, "release", recording_release)

    state = {"w": torch.randn(1 << 21), "b": torch.ones(3, dtype=torch.bool)}  # 8 MiB
    src = Paced(TO, 4, advertise_host="127.0.0.1")
    try:
        with transport() as dst:
            src.send_checkpoint([1], 9, state, TO)
            monkeypatch.setattr(same_host, "_copy_ranges", refusing_copy)
            healed(dst, src, 9, state, "http")
            # the same-host request ended as a fallback (lease kept: used=0), not a failure
            # (None, which would drop the lease the HTTP ranges then rely on)
            assert ("socket", 0) in src.releases, src.releases
            assert ("socket", None) not in src.releases, src.releases
    finally:
        src.shutdown()


def test_receiver_gone_after_metadata_does_not_hold_up_disallow() -> None:
    """A receiver that got the metadata (and a lease) over the same-host socket and then
    vanished without answering must not make disallow_checkpoint wait out its timeout."""
    state = {"w": torch.randn(1000)}
    with transport(timeout=timedelta(seconds=30)) as src:
        src.send_checkpoint([1], 2, state, TO)
        assert src._local is not None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect("\0" + src._local.name)
            same_host.send_frame(s, {"op": "fetch", "step": 2, "wait": 0.0, "chunks": 4})
            assert same_host.recv_frame(s, Deadline.after(5))["ok"] is True
            same_host.recv_raw(s, Deadline.after(5), 1 << 20)
            st = src._staging
            assert st is not None and len(st.leases) == 1
        end = time.monotonic() + 5
        while st.leases and time.monotonic() < end:
            time.sleep(0.01)
        assert not st.leases
        t0 = time.monotonic()
        src.disallow_checkpoint()
        assert time.monotonic() - t0 < 1.0


def test_yama_grant_is_a_no_op_or_succeeds_here() -> None:
    """prctl(PR_SET_PTRACER) is what lets a receiver read the source under Yama ptrace_scope 1.
    This machine may have no Yama (EINVAL); where it has, naming a pid and then nobody works."""
    from ft import _C

    for pid in (os.getpid(), 0):
        assert _C.allow_process_to_read(pid) in (0, errno.EINVAL)


def test_unreachable_endpoint_falls_back_to_http() -> None:
    """A receiver on another host (or network namespace) cannot connect to the abstract socket
    named in the header; it uses HTTP."""
    state = {"w": torch.randn(1000)}
    with transport() as src, transport() as dst:
        src.send_checkpoint([1], 1, state, TO)
        assert src._local is not None
        src._local.close()  # the name in the header now leads nowhere
        healed(dst, src, 1, state, "http")


def _raw_request(name: str, request: Any) -> Any:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect("\0" + name)
        if isinstance(request, bytes):
            s.sendall(request)
        else:
            same_host.send_frame(s, request)
        return same_host.recv_frame(s, Deadline.after(5))


def test_bad_requests_get_clear_errors_and_the_source_keeps_serving() -> None:
    state = {"w": torch.randn(1 << 18)}
    with (
        transport(token="right-right-right-right") as src,
        transport(token="right-right-right-right") as dst,
    ):
        src.send_checkpoint([1], 6, state, TO)
        assert src._local is not None
        name = src._local.name
        right = Signer(JobSecret("right-right-right-right"), SAME_HOST_PURPOSE)
        wrong = Signer(JobSecret("wrong-wrong-wrong-wrong"), SAME_HOST_PURPOSE)

        def signed(signer: Signer = right, what: str = "", **fields: Any) -> Dict[str, Any]:
            req = dict({"op": "fetch", "step": 6, "wait": 0.0, "chunks": 1}, **fields)
            req["auth"] = signer.sign(
                what or same_host.request_what(name),
                same_host.request_body(req["step"], req["wait"], req["chunks"]),
            )
            return req

        used = signed(step=7)
        cases = [
            (lambda: dict(signed(), auth=None), 403, "no signature"),
            # the secret itself is never accepted in place of a signature
            (
                lambda: dict(signed(), auth=None, token="right-right-right-right"),
                403,
                "no signature",
            ),
            (lambda: signed(wrong), 403, "bad signature"),
            (
                lambda: signed(what=same_host.request_what("ft-ckpt-" + "0" * 32)),
                403,
                "bad signature",
            ),
            (lambda: dict(signed(), step=7), 403, "bad signature"),  # altered after signing
            (lambda: used, 404, "step 7"),
            (lambda: used, 403, "replayed"),
            (lambda: signed(step=7), 404, "step 7"),
            (lambda: signed(step=5), 404, "step 5"),
            (lambda: signed(step="6"), 400, "bad step"),
            (lambda: signed(wait="forever"), 400, "bad step, wait"),
            (lambda: signed(chunks=None), 400, "chunks"),
            (lambda: ["not", "an", "object"], 400, "not an object"),
            (lambda: signed(op="steal"), 400, "unknown op"),
            (lambda: signed(op="data"), 400, "unknown op"),
            (lambda: struct.pack(">I", 5) + b"{{{{{", 400, "not JSON"),
            (lambda: struct.pack(">I", 1 << 30), 400, "exceeds"),
        ]
        for make, code, words in cases:
            request = make()
            reply = _raw_request(name, request)
            assert reply["ok"] is False and reply["code"] == code, (request, reply)
            assert words in reply["error"], (request, reply)
        # a refusal surfaces as the matching CheckpointError on a real receiver
        with transport(token="wrong-wrong-wrong-wrong") as bad:
            with pytest.raises(CheckpointAuthError):
                bad.recv_checkpoint(0, src.metadata(), 6, TO)
        healed(dst, src, 6, state, "same-host")
        # nothing stays claimed: the source releases each request (it may still be reading
        # the receiver's final b"D" when recv_checkpoint returns)
        st = src._staging
        assert st is not None
        end = time.monotonic() + 5
        while st.active and time.monotonic() < end:
            time.sleep(0.01)
        assert st.active == 0 and not st.conns
        assert src.wait_delivered(6, 1, timedelta(seconds=5))  # a same-host delivery counts
        src.disallow_checkpoint()
        reply = _raw_request(name, signed())
        assert reply["ok"] is False and reply["code"] == 410, reply


def test_malformed_source_replies_fail_the_heal_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source whose reply names ranges or regions that do not fit the header it sent: the
    receiver raises CheckpointFormatError naming the problem, copies nothing, and its next
    heal works."""
    from ft.checkpointing import CheckpointFormatError

    state = {"w": torch.randn(1 << 19), "v": torch.randn(100)}
    total = sum(t.nbytes for t in state.values())
    real_plan = http_protocol.plan_chunks
    real_regions = same_host._parse_regions
    with transport() as src, transport() as dst:
        for bad_plan, words in (
            (lambda t, n: [(0, t - 1)], f"ranges cover {total - 1} of {total}"),
            (lambda t, n: [(1, t)], "does not continue at byte 0"),
            (lambda t, n: [], "ranges must be a list"),
        ):
            monkeypatch.setattr(http_protocol, "plan_chunks", bad_plan)
            src.send_checkpoint([1], 4, state, TO)  # the source plans its ranges here
            with pytest.raises(CheckpointFormatError, match=words):
                dst.recv_checkpoint(0, src.metadata(), 4, TO)
        monkeypatch.setattr(http_protocol, "plan_chunks", real_plan)
        src.send_checkpoint([1], 4, state, TO)
        monkeypatch.setattr(
            same_host, "_parse_regions", lambda raw, offsets: real_regions(raw[:1], offsets)
        )
        with pytest.raises(CheckpointFormatError, match="expected 2 regions"):
            dst.recv_checkpoint(0, src.metadata(), 4, TO)
        monkeypatch.setattr(same_host, "_parse_regions", real_regions)
        healed(dst, src, 4, state, "same-host")


def test_source_without_the_fetch_request_is_healed_from_over_http(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A source of an earlier ft answers the one-request protocol with 400 "unknown op": the
    receiver uses HTTP instead of failing the heal."""

    def old_serve(self: SameHostSource, conn: socket.socket) -> None:
        same_host.recv_frame(conn, Deadline.after(5))
        same_host.send_frame(conn, {"ok": False, "code": 400, "error": "unknown op 'fetch'"})

    monkeypatch.setattr(SameHostSource, "serve", old_serve)  # bound as the source starts
    state = {"w": torch.randn(1 << 18)}
    src = HTTPTransport(TO, 4, advertise_host="127.0.0.1")
    try:
        with transport() as dst:
            src.send_checkpoint([1], 2, state, TO)
            healed(dst, src, 2, state, "http")
    finally:
        src.shutdown()


def test_native_copy_failure_is_a_transfer_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_copy(pid: int, plan: Any) -> Any:
        raise RuntimeError("std::bad_alloc")

    state = {"w": torch.randn(1 << 18)}
    with transport() as src, transport() as dst:
        src.send_checkpoint([1], 3, state, TO)
        monkeypatch.setattr(same_host, "_copy_ranges", failing_copy)
        with pytest.raises(CheckpointTransferError, match="same-host copy failed"):
            dst.recv_checkpoint(0, src.metadata(), 3, TO)
        monkeypatch.undo()
        assert_same(state, dst.recv_checkpoint(0, src.metadata(), 3, TO))


def test_source_killed_mid_transfer_fails_within_timeout() -> None:
    # --slow paces the source's checksum loop (0.25 s per MiB): the receiver waits on it
    peer = Peer("http", "--step", "1", "--plain", "--big-mb", "16", "--slow", "0.25")
    try:
        url = peer.expect("ready")["url"]
        with transport() as rx:
            run = run_in_thread(lambda: rx.recv_checkpoint(0, url, 1, timedelta(seconds=20)))
            time.sleep(1.0)
            assert run["thread"].is_alive()
            killed = time.monotonic()
            peer.kill9()
            run["thread"].join(15)
            assert not run["thread"].is_alive()
            err = run.get("error")
            assert isinstance(err, CheckpointTransferError), run
            assert "same-host" in str(err)
            assert time.monotonic() - killed < 3
    finally:
        peer.close()


def test_disallow_waits_for_a_same_host_receiver_then_withdraws() -> None:
    """The source's tensors stay untouched until the receiver verified its copy; after
    disallow_checkpoint returns, new receivers are refused."""

    class Paced(HTTPTransport):
        def _pace(self) -> None:
            time.sleep(0.1)

    state = {"w": torch.randn(1 << 20)}  # 4 MiB: 4 paced slices
    src = Paced(TO, 4, advertise_host="127.0.0.1")
    try:
        with transport() as dst:
            src.send_checkpoint([1], 3, state, TO)
            run = run_in_thread(lambda: dst.recv_checkpoint(0, src.metadata(), 3, TO))
            st = src._staging
            assert st is not None
            end = time.monotonic() + 5
            while st.active == 0 and time.monotonic() < end:  # the transfer has started
                time.sleep(0.005)
            assert st.active == 1
            src.disallow_checkpoint()  # waits for the transfer in flight
            state["w"].zero_()  # the caller may now reuse its tensors
            run["thread"].join(10)
            assert "error" not in run, run
            assert dst.last_recv_path == "same-host"
            assert not torch.equal(run["value"]["w"], state["w"])
            with pytest.raises(CheckpointNotAvailableError):
                dst.recv_checkpoint(0, src.metadata(), 3, TO)
    finally:
        src.shutdown()


def test_connections_beyond_the_cap_are_refused_and_the_endpoint_keeps_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each open same-host connection holds a source thread; idle ones past the cap are closed
    at once instead of piling up threads, and receivers are served again once they go."""
    monkeypatch.setattr(same_host, "MAX_CONNECTIONS", 3)
    state = {"w": torch.randn(1000)}
    with transport() as src, transport() as dst:
        src.send_checkpoint([1], 1, state, TO)
        assert src._local is not None
        idle = []
        for _ in range(3):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0" + src._local.name)
            idle.append(s)
        end = time.monotonic() + 5
        while len(src._local._conns) < 3 and time.monotonic() < end:
            time.sleep(0.01)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as extra:
            extra.settimeout(5)
            extra.connect("\0" + src._local.name)
            assert extra.recv(1) == b""  # closed by the source without a word
        for s in idle:
            s.close()
        end = time.monotonic() + 5
        while src._local._conns and time.monotonic() < end:
            time.sleep(0.01)
        healed(dst, src, 1, state, "same-host")


def test_a_checkpoint_without_data_is_delivered_to_a_same_host_receiver_only_once_it_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkpoint with no tensor bytes (a state dict of plain values) is, over HTTP, all in
    its metadata answer; on the same-host path the receiver still reads its answer over the
    source's socket. The source may count that receiver, and release the checkpoint, only once
    its transfer ended: counted at the answer, the release could come before the transfer
    claimed the checkpoint, and the receiver was told it was withdrawn."""
    in_transfer = threading.Event()
    go_on = threading.Event()
    real_serve_data = same_host_source.SameHostSource._serve_data

    def held_serve_data(self: Any, *args: Any) -> None:
        in_transfer.set()
        go_on.wait(10)
        real_serve_data(self, *args)

    monkeypatch.setattr(same_host_source.SameHostSource, "_serve_data", held_serve_data)
    state = {"step": 3, "name": "no tensors here"}
    src = transport()
    try:
        with transport() as dst:
            src.send_checkpoint([1], 3, state, TO)
            run = run_in_thread(lambda: dst.recv_checkpoint(0, src.metadata(), 3, TO))
            assert in_transfer.wait(10)
            assert not src.wait_delivered(3, 1, timedelta(seconds=0.2))
            go_on.set()
            assert src.wait_delivered(3, 1, TO)
            run["thread"].join(10)
            assert "error" not in run, run
            assert dst.last_recv_path == "same-host"
            assert run["value"] == state
    finally:
        go_on.set()
        src.shutdown()
