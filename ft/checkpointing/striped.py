"""A striped heal: the receiver takes disjoint byte ranges of one checkpoint from every source
that serves it at once, so that across hosts, where the receiver's link is the limit, the heal
takes the sum of the sources' links (docs/design.md, "Heal", "Striped heal").

How:
  * Metadata is asked of every source at once (``stripe=primary`` of the assigned one,
    ``stripe=helper`` of the others, which are asked to wait at most
    ``StripeOptions.helper_wait_s``: one that is not staging the step is not a source). Every
    answer is checked as a single-source fetch checks it (CRC-32, the source's MAC with a job
    secret), and must describe the same step, tree, tensors and byte count as the first one:
    a source that differs fails the heal (``CheckpointCorruptError``), it does not silently
    give part of the state.
  * The checkpoint is cut into the sources' same-host ranges (``staging.LOCAL_RANGES``): each
    source's connections take the next range not yet taken, so a faster link takes more. Every
    range is read straight into the preallocated tensors and checked against the CRC-32C (and
    MAC) its source sent.
  * A source that fails (refuses, closes, or sends nothing for ``stall_timeout_s``: a link
    that went down) is dropped and its unfinished ranges go to the others. Only when no source
    is left does the heal fail, naming why each one was dropped.
  * Each source's digest (the CRC-32C of every range, from its own memory) is fetched too:
    every range received must match the digest of at least one source other than the one that
    sent it, and every digest received must match every range. Sources that hold different
    bytes for the same step fail the heal; nothing is returned.
  * At the end every source is told ``done`` (its lease ends; the assigned source counts a
    delivery), so that no source waits for a receiver that no longer reads.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

import torch

from ft.checkpointing import http_protocol as wire
from ft.checkpointing import serialization as ser
from ft.checkpointing.staging import LOCAL_RANGES
from ft.checkpointing import errors
from ft.utils.deadline import Deadline, Timeout

__all__ = ["StripeOptions", "StripedFetch"]

logger = logging.getLogger(__name__)

# After a failed done request the receiver does not retry: the source's lease ends by itself at
# its deadline. This bounds how long the done requests may hold the receiver's return.
_DONE_WAIT_S = 2.0


@dataclass(frozen=True)
class StripeOptions:
    """How a striped heal uses its sources."""

    helper_wait_s: float = 2.0
    """How long a source other than the assigned one may wait for the step to be staged before
    answering that it does not serve it (it is then no source of this heal). The assigned
    source gets the whole wait of a single-source fetch."""
    stall_timeout_s: float = 5.0
    """A source that sends nothing for this long (its link went down, its process froze) is
    dropped, and its unfinished ranges go to the other sources."""
    connections_per_source: int = 0
    """Parallel connections to each source; 0: ``num_chunks`` shared among the sources (at
    least one each)."""


class _Source:
    """One source of a striped heal and what it did."""

    def __init__(self, index: int, rank: int, metadata: str, primary: bool) -> None:
        self.index = index
        self.rank = rank
        self.metadata = metadata
        self.primary = primary
        url = urlsplit(metadata)
        if url.scheme not in ("http", "https") or not url.hostname or not url.port:
            raise errors.CheckpointError(
                f"bad checkpoint address {metadata!r} (want http://host:port)"
            )
        self.host: str = url.hostname
        self.port: int = url.port
        self.secure = url.scheme == "https"
        self.where = f"checkpoint from rank {rank} at {metadata}"
        self.staging = ""
        self.lease = ""
        self.digest: Optional[List[Tuple[int, int, int]]] = None
        self.error: Optional[BaseException] = None  # why it was dropped
        self.served = 0  # bytes received from it
        self.ranges = 0


class StripedFetch:
    """One striped fetch (see the module docstring); ``run`` returns the state dict.

    ``fetcher`` is the transport's CheckpointFetcher: its requests (signed), metadata checks
    and range reads are the ones a single-source fetch uses.
    """

    def __init__(
        self,
        fetcher: Any,
        sources: Sequence[Tuple[int, str]],
        step: int,
        timeout: Timeout,
        options: StripeOptions,
        num_chunks: int,
    ) -> None:
        self._f = fetcher
        self._step = step
        self._timeout = timeout
        self._opts = options
        self._deadline = Deadline.after(timeout)
        self._sources = [_Source(i, r, m, i == 0) for i, (r, m) in enumerate(sources)]
        per = options.connections_per_source or -(-num_chunks // len(self._sources))
        self._per_source = max(1, per)
        self._cond = threading.Condition()
        # set once the first metadata answer is checked
        self._tree: Any = None
        self._specs: Optional[List[ser.TensorSpec]] = None
        self._header_key: Any = None
        self._offsets: List[int] = []
        self._views: List[memoryview] = []
        self._tensors: List[torch.Tensor] = []
        self._units: List[Tuple[int, int]] = []
        self._todo: List[int] = []  # units not taken, next first
        self._crcs: Dict[int, Tuple[int, int]] = {}  # unit -> (crc, source index)
        self._fatal: Optional[BaseException] = None
        self._pending_meta = len(self._sources)
        self._workers = 0
        self._threads: List[threading.Thread] = []
        # set when the fetch ends: range reads still running stop at their next slice
        self._stop = threading.Event()

    # ------------------------------------------------------------------ driver

    def run(self) -> Tuple[Any, List[torch.Tensor], List[ser.TensorSpec]]:
        """Returns (tree, tensors, specs) of the verified checkpoint; raises CheckpointError."""
        ok = False
        try:
            for s in self._sources:
                self._spawn(self._source_main, s)
            with self._cond:
                self._deadline.wait(self._cond, self._settled)
                if self._fatal is not None:
                    raise self._fatal
                if self._specs is None or len(self._crcs) < len(self._units):
                    raise self._no_source_left()
                # every range is in; the digests of the sources still up come next
                self._deadline.wait(self._cond, self._digests_settled)
            self._verify_digests()
            ok = True
            assert self._specs is not None
            return self._tree, self._tensors, self._specs
        finally:
            self._stop.set()
            with self._cond:
                if self._fatal is None and not ok:
                    self._fatal = errors.CheckpointTransferError("the striped fetch ended")
                self._cond.notify_all()
            self._finish(ok)

    def served(self) -> Dict[str, int]:
        """Bytes received from each source, by its metadata."""
        return {s.metadata: s.served for s in self._sources}

    def _settled(self) -> bool:
        if self._fatal is not None:
            return True
        if self._specs is not None and len(self._crcs) == len(self._units):
            return True
        # nobody can make progress any more: no source reads, and no metadata may still come
        return self._workers == 0 and self._pending_meta == 0

    def _digests_settled(self) -> bool:
        return self._fatal is not None or all(
            s.digest is not None or s.error is not None or not s.lease for s in self._sources
        )

    def _no_source_left(self) -> errors.CheckpointError:
        why = "; ".join(
            f"rank {s.rank} ({s.metadata}): {type(s.error).__name__}: {s.error}"
            for s in self._sources
            if s.error is not None
        )
        if self._deadline.expired:
            return errors.CheckpointTransferError(
                f"checkpoint step {self._step}: timed out after {self._timeout} with "
                f"{len(self._crcs)} of {len(self._units)} ranges received ({why or 'no source answered'})"
            )
        failures = [s.error for s in self._sources if s.error is not None]
        # the most telling of a single source's failures keeps its type (a refusal of the
        # secret stays an auth error); the message names every source
        for kind in (errors.CheckpointAuthError, errors.CheckpointNotAvailableError):
            if failures and all(isinstance(e, kind) for e in failures):
                err = kind(f"checkpoint step {self._step}: no source left: {why}")
                return err
        return errors.CheckpointTransferError(
            f"checkpoint step {self._step}: no source left with {len(self._units) - len(self._crcs)} "
            f"of {len(self._units)} ranges missing: {why}"
        )

    def _spawn(self, fn: Any, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True, name="ft-ckpt-stripe")
        self._threads.append(t)
        t.start()

    def _drop(self, s: _Source, e: BaseException) -> None:
        """Caller holds the condition."""
        if s.error is None:
            s.error = e
            logger.warning("striped heal: dropped source %s (%s)", s.metadata, e)
        self._cond.notify_all()

    # ------------------------------------------------------------------ per source

    def _source_main(self, s: _Source) -> None:
        """Asks ``s`` for the metadata, then runs its connections and fetches its digest."""
        try:
            self._meta(s)
        except BaseException as e:  # noqa: BLE001 - recorded, judged by the driver
            with self._cond:
                self._pending_meta -= 1
                self._drop(s, e)
                if isinstance(e, (errors.CheckpointCorruptError, errors.CheckpointFormatError)):
                    self._fatal = self._fatal or e
            return
        with self._cond:
            self._pending_meta -= 1
            if self._fatal is not None:
                return
            self._workers += self._per_source
            self._cond.notify_all()
        for _ in range(self._per_source - 1):
            self._spawn(self._worker, s)
        if len(self._sources) > 1:
            # on its own connection: a source that has not prepared its range checksums yet
            # computes them for this answer, and its data connections must not wait for that
            self._spawn(self._fetch_digest, s)
        self._worker(s)

    def _meta(self, s: _Source) -> None:
        wait_s = wire.server_wait(self._deadline)
        if not s.primary:
            wait_s = min(wait_s, self._opts.helper_wait_s)
        path = (
            f"{wire.PREFIX}{self._step}/meta?chunks={self._per_source}&wait={wait_s:.3f}"
            f"&stripe={'primary' if s.primary else 'helper'}"
        )
        body, lease = self._f.get_metadata(
            s.host, s.port, path, self._deadline, s.where, secure=s.secure
        )
        tree, specs, staging, lease = self._f.parse_metadata(body, lease, self._step, s.where)
        key = (repr(tree), [(sp.dtype, tuple(sp.shape), sp.nbytes) for sp in specs])
        with self._cond:
            s.staging, s.lease = staging, lease
            if self._specs is None:
                self._adopt(tree, specs, key)
            elif key != self._header_key:
                raise errors.CheckpointCorruptError(
                    f"checkpoint step {self._step}: {s.where} describes a different state "
                    f"(tensors or structure) than {self._sources[0].metadata if self._sources[0].lease else 'the first source'}; "
                    "the sources of a striped heal must hold the same checkpoint"
                )

    def _adopt(self, tree: Any, specs: List[ser.TensorSpec], key: Any) -> None:
        """The first checked metadata: allocates the tensors and plans the ranges. Caller
        holds the condition."""
        self._tree, self._specs, self._header_key = tree, specs, key
        self._tensors = [ser.allocate(sp, torch.device("cpu")) for sp in specs]
        self._offsets = [0]
        for t, sp in zip(self._tensors, specs):
            self._views.append(ser.memview(t))
            self._offsets.append(self._offsets[-1] + sp.nbytes)
        self._units = wire.plan_chunks(self._offsets[-1], LOCAL_RANGES)
        self._todo = list(range(len(self._units)))

    def _take(self, s: _Source) -> Optional[int]:
        """The next range for ``s`` to fetch; None when it should stop. Waits while ranges
        are in flight elsewhere (one may come back if its source fails)."""
        with self._cond:
            while True:
                if self._fatal is not None or s.error is not None:
                    return None
                if self._todo:
                    return self._todo.pop(0)
                if len(self._crcs) == len(self._units):
                    return None
                if not self._deadline.wait(
                    self._cond,
                    lambda: (
                        bool(self._todo)
                        or self._fatal is not None
                        or len(self._crcs) == len(self._units)
                    ),
                ):
                    return None

    def _worker(self, s: _Source) -> None:
        try:
            while True:
                k = self._take(s)
                if k is None:
                    return
                a, b = self._units[k]
                path = (
                    f"{wire.PREFIX}{self._step}/data?staging={s.staging}&lease={s.lease}"
                    f"&start={a}&end={b}"
                )
                try:
                    crc = self._f.fetch_range(
                        s.host,
                        s.port,
                        path,
                        a,
                        b,
                        self._offsets,
                        self._views,
                        self._deadline,
                        self._stop,
                        s.where,
                        secure=s.secure,
                        stall_s=self._opts.stall_timeout_s,
                    )
                except (errors.CheckpointCorruptError, errors.CheckpointAuthError) as e:
                    with self._cond:
                        self._todo.insert(0, k)
                        self._drop(s, e)
                        self._fatal = self._fatal or e
                    return
                except errors.CheckpointError as e:
                    with self._cond:
                        self._todo.insert(0, k)  # another source takes it
                        self._drop(s, e)
                    return
                with self._cond:
                    self._crcs[k] = (crc, s.index)
                    s.served += b - a
                    s.ranges += 1
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._workers -= 1
                self._cond.notify_all()

    def _fetch_digest(self, s: _Source) -> None:
        path = f"{wire.PREFIX}{self._step}/digest?staging={s.staging}&lease={s.lease}"
        try:
            conn, resp, sock, signature = self._f.open(
                s.host, s.port, path, self._deadline, s.where, s.secure
            )
            try:
                body = resp.read(1 << 20)
                mac = resp.getheader(wire.CONTENT_MAC_HEADER, "")
            finally:
                resp.close()
                conn.close()
            if self._f.content_signer is not None:
                try:
                    raw = bytes.fromhex(mac)
                except ValueError:
                    raw = b""
                if not self._f.content_signer.check(raw, b"digest", signature, body):
                    raise errors.CheckpointAuthError(
                        f"{s.where}: the digest is not signed with the job secret; the source "
                        "is not a member of this job"
                    )
            try:
                digest = wire.decode_digest(body, self._offsets[-1])
            except (ValueError, UnicodeDecodeError) as e:
                raise errors.CheckpointFormatError(f"{s.where}: bad digest: {e}") from None
            if [(a, b) for a, b, _ in digest] != self._units:
                raise errors.CheckpointFormatError(f"{s.where}: the digest covers other ranges")
        except errors.CheckpointAuthError as e:
            with self._cond:
                self._drop(s, e)
                self._fatal = self._fatal or e
            return
        except errors.CheckpointError as e:
            with self._cond:
                self._drop(s, e)
            return
        except (OSError, ValueError) as e:  # http.client's failures while reading the answer
            with self._cond:
                self._drop(s, errors.CheckpointTransferError(f"{s.where}: digest failed: {e}"))
            return
        with self._cond:
            s.digest = digest
            self._cond.notify_all()

    # ------------------------------------------------------------------ checks and end

    def _verify_digests(self) -> None:
        """Every received range matches every digest, and (where more than one source sent
        ranges) the digest of a source other than its sender."""
        with self._cond:
            digests = [(s.index, s.digest) for s in self._sources if s.digest is not None]
            senders = {src for _, src in self._crcs.values()}
            crcs = dict(self._crcs)
        for k, (crc, src) in crcs.items():
            for idx, d in digests:
                if d[k][2] != crc:
                    a, b = self._units[k]
                    raise errors.CheckpointCorruptError(
                        f"checkpoint step {self._step}: the sources hold different bytes "
                        f"[{a}, {b}) (rank {self._sources[src].rank} sent what rank "
                        f"{self._sources[idx].rank}'s digest does not match); nothing loaded"
                    )
            if len(senders) > 1 and not any(idx != src for idx, _ in digests):
                a, b = self._units[k]
                raise errors.CheckpointTransferError(
                    f"checkpoint step {self._step}: bytes [{a}, {b}) could not be checked "
                    "against a second source (no other source's digest arrived); nothing "
                    "loaded"
                )

    def _finish(self, ok: bool) -> None:
        """Ends every lease (``done``), in parallel, without waiting long for them."""
        sources = [s for s in self._sources if s.lease and s.staging]
        done_deadline = Deadline.after(_DONE_WAIT_S)

        def done(s: _Source) -> None:
            path = (
                f"{wire.PREFIX}{self._step}/done?staging={s.staging}&lease={s.lease}"
                f"&ok={1 if ok else 0}"
            )
            try:
                conn, resp, _, _ = self._f.open(
                    s.host, s.port, path, done_deadline, s.where, s.secure
                )
                resp.close()
                conn.close()
            except (errors.CheckpointError, OSError) as e:
                logger.debug("striped heal: done to %s failed: %s", s.metadata, e)

        # A dropped source is told too (it may only have stalled), but not waited for: its
        # link may be down.
        waited = []
        for s in sources:
            t = threading.Thread(target=done, args=(s,), daemon=True, name="ft-ckpt-done")
            t.start()
            if s.error is None:
                waited.append(t)
        for t in waited:
            t.join(done_deadline.remaining())
        logger.info(
            "striped heal of step %d: %s",
            self._step,
            ", ".join(
                f"{s.metadata}: {s.served} bytes in {s.ranges} ranges" for s in self._sources
            ),
        )
