"""The source side of the same-host path (protocol and receiving side in same_host.py).

For same-host receivers, a staged checkpoint is also prepared in the background (see
:meth:`SameHostSource.prepare`): CPU tensors of 2 MiB or more are copied into huge-page memory
(at most a quarter of the memory available, divided by ``LOCAL_WORLD_SIZE``; above that the
tensors are served in place) and the byte ranges the path verifies are checksummed, while the
healer is still finding this source.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Dict, Optional

from ft import _C  # ft's compiled extension (torch's _C naming)
from ft.checkpointing import same_host
from ft.checkpointing import http_protocol as wire
from ft.checkpointing.served import ServedCheckpoint
from ft.checkpointing.http_protocol import Refused
from ft.checkpointing.staging import Abort, Staging
from ft.utils.auth import SAME_HOST_PURPOSE, AuthError, JobSecret, Verifier
from ft.utils.deadline import Deadline

__all__ = ["SameHostSource", "host_copy_budget"]

logger = logging.getLogger(__name__)

# Most a receiver waits for another receiver's ptrace grant (the setting names one pid at a
# time) before it is served without one: it then falls back to HTTP, which costs speed only,
# and a same-host copy of a usual checkpoint ends well within this.
_PTRACER_LOCK_WAIT_S = 2.0
# After a failed send of a checksum, how long to look for the receiver's answer that may
# already be queued (b"F": it fell back to HTTP) before calling the transfer failed.
_FALLBACK_ANSWER_WAIT_S = 0.1


def host_copy_budget() -> int:
    """Most bytes of CPU tensors a source copies into huge pages for same-host receivers: a
    quarter of the memory available now, shared by the ranks this host runs per group
    (``LOCAL_WORLD_SIZE``; they may all send at once). 0 where that cannot be read."""
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // (4 * local_ranks)
    except (OSError, ValueError, IndexError):
        pass
    return 0


class SameHostSource:
    """Answers same-host fetches for the checkpoint ``served`` holds.

    Contract:
      - Only connections of this process's uid are read (same_host.LocalEndpoint), and with
        a job secret only requests signed with it for this endpoint, never replayed (else 403);
        nothing is granted before that check.
      - A request is validated and refused exactly like its HTTP twin (``served``'s ``meta``
        and ``claim``), and the refusal carries the same status.
      - A receiver is named this process's ptracer (Yama ptrace_scope 1) only for its own
        transfer, one receiver at a time, and the grant is revoked when the transfer ends.
      - The checkpoint stays claimed, so its tensors untouched, until the receiver says it
        verified everything or falls back to HTTP, or ``timeout`` passes.
      - Tensors are read only through Staging.slices: nothing reads them once withdrawn.

    Raises OSError when the endpoint cannot be opened (the caller serves HTTP only).
    """

    def __init__(
        self, served: ServedCheckpoint, secret: Optional[JobSecret], timeout_s: float
    ) -> None:
        self._served = served
        self._timeout_s = timeout_s
        self._verifier = Verifier(secret, SAME_HOST_PURPOSE) if secret else None
        self._ptracer_lock = threading.Lock()
        self.endpoint = same_host.LocalEndpoint(self.serve)

    def close(self, join_timeout: float) -> None:
        self.endpoint.close(join_timeout=join_timeout)

    # ------------------------------------------------------------------ preparation

    def prepare(self, st: Staging) -> None:
        """Starts the background preparation of ``st`` (see the module's docstring)."""
        st.preparer = threading.Thread(
            target=self._prepare, args=(st,), daemon=True, name="ft-ckpt-prepare"
        )
        st.preparer.start()

    def _prepare(self, st: Staging) -> None:
        """Runs while a healer is still finding this source (milliseconds): moves large CPU
        tensors onto huge pages (within the memory budget) and, for a checkpoint of CPU tensors
        only, checksums the same-host ranges, so that a same-host receiver's copy is the fast
        one and its checksums are ready. Reads only CPU tensors, in pieces, and stops at the
        next piece once the checkpoint closes."""
        try:
            cpu_bytes = st.cpu_bytes()
            if cpu_bytes <= host_copy_budget():
                st.copy_cpu_tensors_to_huge_pages()
            if cpu_bytes != st.total:
                # Accelerator tensors are copied to the host when a receiver asks, on its
                # serving thread: a background device copy would compete with training and
                # could not stop mid-tensor at disallow_checkpoint.
                return
            for k in range(len(st.local_ranges)):
                if st.closing:
                    return
                st.range_crc(k)
        except Abort:
            pass
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: serving works without it
            logger.warning(
                "preparing checkpoint step %d for same-host receivers stopped: %s", st.step, e
            )

    # ------------------------------------------------------------------ serving

    def serve(self, conn: socket.socket) -> None:
        """One same-host fetch (protocol in same_host.py), validated like its HTTP twins: sends
        the metadata and the tensors' addresses, then each range's CRC-32C, and holds the
        checkpoint until the receiver says it verified everything (or falls back to HTTP)."""
        deadline = Deadline.after(self._timeout_s)
        try:
            try:
                # a receiver sends its request as it connects: an idle socket is not kept
                req = same_host.recv_frame(conn, deadline.sooner(same_host.REQUEST_TIMEOUT_S))
            except (EOFError, OSError):  # TimeoutError too
                return  # connected and left, or idled: nothing asked
            if type(req) is not dict:
                raise Refused(400, "request is not an object")
            self._check_auth(req)
            op = req.get("op")
            if op != "fetch":
                raise Refused(400, f"unknown op {op!r:.40}")
            step, wait_s, chunks = req.get("step"), req.get("wait"), req.get("chunks")
            if type(step) is not int or type(wait_s) not in (int, float) or type(chunks) is not int:
                raise Refused(400, "bad step, wait or chunks")
            st, body, lease = self._served.meta(step, wait_s, chunks, claim_on=conn)
        except (Refused, ValueError) as e:
            code, msg = (e.code, e.msg) if isinstance(e, Refused) else (400, str(e))
            same_host.send_frame(conn, {"ok": False, "code": code, "error": msg})
            return
        self._serve_data(conn, st, lease, body, deadline)

    def _check_auth(self, req: Dict[str, Any]) -> None:
        """Refuses (403) a request not signed with the job secret for this endpoint, or signed
        before (a replay). Nothing is granted before this passes."""
        if self._verifier is None:
            return
        token = req.get("auth")
        try:
            self._verifier.verify(
                same_host.request_what(self.endpoint.name),
                same_host.request_body(req.get("step"), req.get("wait"), req.get("chunks")),
                token if type(token) is str else None,
            )
        except AuthError as e:
            raise Refused(
                403, f"refused: {e}; this source requires a signature made with the job secret"
            ) from None

    def _serve_data(
        self, conn: socket.socket, st: Staging, lease_id: str, body: bytes, deadline: Deadline
    ) -> None:
        used: Optional[int] = None
        granted = False
        try:
            granted = self._grant_read_access(conn, deadline)
            st.regions_sent = True
            regions = [[st.cpu(i).data_ptr(), spec.nbytes] for i, spec in enumerate(st.specs)]
            ranges = st.local_ranges
            same_host.send_frame(
                conn,
                {
                    "ok": True,
                    "lease": lease_id,
                    "regions": regions,
                    "ranges": [list(r) for r in ranges],
                },
            )
            same_host.send_raw(conn, body)
            answer: Optional[bytes] = None
            for k in range(len(ranges)):
                # a receiver that falls back (or gives up) says so early: stop checksumming
                answer = same_host.poll_answer(conn)
                if answer is not None:
                    break
                crc = st.range_crc(k)
                try:
                    same_host.send_crc(conn, k, crc)
                except OSError:
                    answer = same_host.poll_answer(conn, wait=_FALLBACK_ANSWER_WAIT_S)
                    if answer is None:
                        raise
                    break
            if answer is None:
                # the receiver may still be copying: the tensors stay untouched until it answers
                answer = same_host.recv_exact(conn, 1, deadline)
            if answer == same_host.DONE:
                used = len(ranges) + wire.MAX_CHUNKS  # the whole lease
            elif answer == same_host.FALLBACK:
                used = 0  # it will fetch the ranges over HTTP with the same lease
        except Abort:
            logger.debug("same-host checkpoint transfer cut off (withdrawn)")
        except (OSError, EOFError, TimeoutError) as e:
            logger.debug("same-host checkpoint transfer failed: %s", e)
        finally:
            if granted:
                _C.allow_process_to_read(0)
                self._ptracer_lock.release()
            self._served.release(st, lease_id, conn, used)

    def _grant_read_access(self, conn: socket.socket, deadline: Deadline) -> bool:
        """Under Yama ptrace_scope 1, names the receiver as this process's ptracer for the
        transfer (one receiver at a time: the setting holds one pid). True if granted (the
        caller revokes it and releases the lock). Without the grant the receiver's first read
        fails and it falls back to HTTP, so a busy lock or an invisible pid only costs speed.
        Reached only by a request of this uid that passed ``_check_auth``."""
        if not same_host.ptracer_needed():
            return False
        pid, uid, _ = same_host.peer_creds(conn)
        if (
            pid <= 0
            or uid != os.geteuid()
            or not self._ptracer_lock.acquire(
                timeout=deadline.sooner(_PTRACER_LOCK_WAIT_S).remaining()
            )
        ):
            return False
        err = _C.allow_process_to_read(pid)
        if err:
            self._ptracer_lock.release()
            logger.debug("prctl(PR_SET_PTRACER, %d) failed: %s", pid, os.strerror(err))
            return False
        return True
