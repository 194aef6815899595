"""HTTPTransport: a healthy replica serves its state dict over HTTP; recovering replicas pull it.

HTTPTransport composes three parts, each in its own module:

- checkpoint_server.py: the source. It stages a state dict (keeping references, serializing
  nothing until asked), hands out leases, and answers metadata and data requests
  (http_protocol.py has the wire protocol and what is signed with a job secret).
  ``disallow_checkpoint`` waits (bounded by the timeout) until transfers that already started
  have finished, so that after it returns the caller may mutate the tensors again.
- fetcher.py: the receiver. It pulls a checkpoint in parallel byte ranges and checks every
  byte (CRC, and the source's MAC with a secret); on a mismatch it raises
  :class:`CheckpointCorruptError` and returns nothing.
- same_host_source.py: the source side of the same-host path (same_host.py), which a receiver
  on the source's host takes instead of loopback TCP; ``send_checkpoint`` also prepares the
  staged tensors for it in the background.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch

from ft.checkpointing import same_host as same_host_path
from ft.checkpointing.checkpoint_server import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    CheckpointServer,
    default_advertise_host,
)
from ft.checkpointing.fetcher import CheckpointFetcher
from ft.checkpointing.http_protocol import MAX_CHUNKS as _MAX_CHUNKS  # noqa: F401 - re-export
from ft.checkpointing.http_protocol import plan_chunks
from ft.checkpointing.same_host_source import SameHostSource
from ft.checkpointing.served import ServedCheckpoint
from ft.checkpointing.staging import Staging
from ft.checkpointing.striped import StripeOptions
from ft.checkpointing.transport import CheckpointTransport
from ft.utils import net
from ft.utils.auth import JobSecret, SecretLike, resolve_secret
from ft.utils.deadline import Deadline, to_seconds
from ft.utils.tls import TLSConfig

T = TypeVar("T")

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "HTTPTransport",
    "default_advertise_host",
    "plan_chunks",
]

logger = logging.getLogger(__name__)

TOKEN_ENV = "FT_CHECKPOINT_TOKEN"
ADVERTISE_ENV = net.ADVERTISE_ENV
PORT_ENV = "FT_CHECKPOINT_PORT"
SAME_HOST_ENV = "FT_CHECKPOINT_SAME_HOST"


@contextlib.contextmanager
def _time(desc: str) -> Iterator[None]:
    """Logs how long the block took. torchft's private name, kept because torchft's transfer
    benchmark (which its test suite runs) imports it from here."""
    start = time.perf_counter()
    yield
    logger.info("%s took %.3fs", desc, time.perf_counter() - start)


# At shutdown(wait=True), how long the serving threads get to end: every connection has been
# cut off by then, so they end within one read or write; the bound keeps a stuck one from
# holding shutdown (the timeout applies if shorter).
_SHUTDOWN_JOIN_S = 5.0


class HTTPTransport(CheckpointTransport[T]):
    """Checkpoint transport over HTTP, with parallel chunks, checksums and an optional token.

    Contract: a receiver gets a state dict only when every byte was checked against what the
    source served (and, with a job secret, signed by a job member); the source serves a state
    dict only under the step it was staged for, and reads it no more once
    ``disallow_checkpoint`` returns.

    Args:
        timeout: default bound for transfers and for waits inside the server.
        num_chunks: parallel connections (byte ranges) a receiver uses; 0 or 1: one.
        token: the job secret under its older name (default: env ``FT_CHECKPOINT_TOKEN``);
            prefer ``secret``.
        secret: the job secret (ft.utils.auth; default: ``FT_JOB_SECRET_FILE`` /
            ``FT_JOB_SECRET``): requests are signed with it and refused without it, and what
            the source serves is signed and checked with it. None anywhere: no authentication.
        insecure: allow serving beyond loopback without a secret (default: ``FT_INSECURE``).
        tls: serve over TLS and verify TLS sources (ft.utils.tls; default: ``FT_TLS_*``).
            :meth:`metadata` then says ``https://``.
        advertise_host: host put in ``metadata()`` (default: env ``FT_ADVERTISE_HOST`` or
            :func:`default_advertise_host`).
        bind_host: interface to listen on (default: the advertised host's address; ``"::"``:
            every interface).
        port: port to listen on (default: env ``FT_CHECKPOINT_PORT``, else any free port; pin
            it where a firewall must open it).
        device: where received tensors are placed (default CPU).
        same_host: serve and use the same-host path (see ``same_host.py``): a receiver on the
            source's host copies the tensors straight from the source process instead of
            through loopback TCP, falling back to HTTP where the kernel does not allow it.
            Default: on, unless env ``FT_CHECKPOINT_SAME_HOST=0``.
        idle_timeout_s: a connection must deliver its request line and headers this long after
            connecting, or it is closed (default :data:`DEFAULT_IDLE_TIMEOUT_S`). Transfers
            under way are bounded by ``timeout`` only, never by this.
        max_connections: most connections the server holds open at once; more are answered
            503 and closed at once (default :data:`DEFAULT_MAX_CONNECTIONS`).
        stripe: how :meth:`recv_checkpoint_striped` uses its sources (default
            :class:`~ft.checkpointing.striped.StripeOptions`).
    """

    # The server counts the receivers that have read a whole checkpoint (wait_delivered).
    confirms_delivery = True

    def __init__(
        self,
        timeout: timedelta,
        num_chunks: int,
        token: Optional[str] = None,
        advertise_host: Optional[str] = None,
        bind_host: Optional[str] = None,
        port: Optional[int] = None,
        device: Optional[torch.device] = None,
        same_host: Optional[bool] = None,
        *,
        secret: SecretLike = None,
        insecure: Optional[bool] = None,
        tls: Optional[TLSConfig] = None,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        stripe: Optional[StripeOptions] = None,
    ) -> None:
        if port is None:
            port = int(os.environ.get(PORT_ENV) or 0)
        num_chunks = max(1, int(num_chunks))  # checked before anything listens
        # explicit secret, explicit token, the job secret's settings, then the older
        # FT_CHECKPOINT_TOKEN (so a leftover token never shadows the job secret)
        if secret is None:
            secret = token
        resolved: Optional[JobSecret] = resolve_secret(secret)
        if resolved is None and os.environ.get(TOKEN_ENV):
            resolved = JobSecret(os.environ[TOKEN_ENV], source=TOKEN_ENV)
        device = torch.device("cpu") if device is None else torch.device(device)

        timeout_s = to_seconds(timeout)
        if timeout_s is None:
            raise TypeError("HTTPTransport needs a timeout (a timedelta or seconds)")
        # the checkpoint this source serves (both paths read it), and its HTTP server
        self._served = ServedCheckpoint(timeout_s, self._pace)
        self._checkpoints = CheckpointServer(
            self._served,
            timeout,
            secret=resolved,
            insecure=insecure,
            tls=tls,
            advertise_host=advertise_host,
            bind_host=bind_host,
            port=port,
            idle_timeout_s=idle_timeout_s,
            max_connections=max_connections,
        )
        # the listening HTTP server (its bounds and connections are what tests inspect)
        self._server = self._checkpoints.httpd
        self._stripe = stripe or StripeOptions()

        if same_host is None:
            same_host = os.environ.get(SAME_HOST_ENV, "1") != "0"
        use_same_host = bool(same_host) and same_host_path.supported()
        self._fetcher = CheckpointFetcher(
            num_chunks=num_chunks,
            secret=resolved,
            tls=self._checkpoints.tls,
            device=device,
            same_host=use_same_host,
        )
        self._same_host_source: Optional[SameHostSource] = None
        if use_same_host:
            try:
                self._same_host_source = SameHostSource(self._served, resolved, timeout_s)
            except OSError as e:
                logger.warning("same-host checkpoint endpoint unavailable (%s); HTTP only", e)
        # the endpoint same-host receivers connect to (None: HTTP only)
        self._local: Optional[same_host_path.LocalEndpoint] = (
            self._same_host_source.endpoint if self._same_host_source is not None else None
        )

    # ------------------------------------------------------------------ public interface

    def metadata(self) -> str:
        """``http://host:port``, plus ``#<name>`` of the same-host endpoint when it serves one
        (a URL fragment: HTTP clients never send it)."""
        url = self._checkpoints.url()
        return f"{url}#{self._local.name}" if self._local is not None else url

    def address(self) -> str:
        return self.metadata()

    @property
    def last_recv_path(self) -> Optional[str]:
        """Which path the last successful recv_checkpoint took: "same-host" or "http"."""
        return self._fetcher.last_path

    def send_checkpoint(
        self, dst_ranks: List[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Stages ``state_dict`` for ``step`` (keeps references; serializes on request).

        Raises TypeError (naming the key path) for values that cannot be sent safely. A
        previously staged checkpoint is withdrawn first.
        """
        staging = self._served.stage(step, state_dict)
        if self._same_host_source is not None:
            self._same_host_source.prepare(staging)
        logger.debug(
            "staged checkpoint step=%d bytes=%d tensors=%d for %s",
            step,
            staging.total,
            len(staging.tensors),
            dst_ranks,
        )

    def allow_checkpoint(self, step: int) -> None:
        """torchft's counterpart of :meth:`disallow_checkpoint`, kept for its callers.

        Here :meth:`send_checkpoint` serves what it stages at once, and
        :meth:`disallow_checkpoint` drops it, so there is nothing to re-allow: this returns
        when the checkpoint of ``step`` is being served, and raises CheckpointError otherwise
        (torchft would serve the previous state dict under the new step; ft never serves a
        state dict under a step it was not staged for).
        """
        self._served.check_staged(step)

    def abandon_checkpoint(self, step: int, reason: str) -> None:
        """Receivers waiting for ``step`` get HTTP 409 naming ``reason`` at once."""
        self._served.abandon(step, reason)

    def expect_checkpoint(self, step: int) -> None:
        """Receivers asking for ``step`` wait for it until it is staged or abandoned, even if
        it was withdrawn or abandoned before (a retry of the same step)."""
        self._served.expect(step)

    def wait_delivered(self, step: int, receivers: int, timeout: timedelta) -> bool:
        """Waits until ``receivers`` receivers have read all of the checkpoint of ``step``
        (over HTTP or the same-host path); False at ``timeout`` or once it is withdrawn."""
        return self._served.wait_delivered(step, receivers, Deadline.after(timeout))

    def wait_asked(self, step: int, receivers: int, timeout: timedelta) -> bool:
        """Waits until ``receivers`` receivers have asked for the checkpoint of ``step`` (a
        metadata answer each, over HTTP or the same-host path, striped or not), or until
        nobody new can (it is not staged, or :meth:`wait_delivered` released it): True; False
        at ``timeout``. A donor of a striped heal waits for this before :meth:`wait_delivered`,
        which does not wait for receivers that have not come yet."""
        return self._served.wait_asked(step, receivers, Deadline.after(timeout))

    def disallow_checkpoint(self) -> None:
        """Withdraws the staged checkpoint.

        New requests get 410 at once, and so do receivers that got the metadata but have not
        started reading data (their leases are dropped, not waited for). Transfers that already
        started, and the other ranges of their receivers (asked for at the same moment), get
        up to ``timeout`` to finish; then they are cut off. When this returns, no server thread
        reads the tensors.
        """
        self._served.withdraw()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetches the checkpoint for ``step`` from the server at ``metadata`` (its URL).

        Raises:
            CheckpointCorruptError: a checksum did not match (nothing is returned).
            CheckpointAuthError: the server refused the token.
            CheckpointNotAvailableError: the server does not serve ``step``.
            CheckpointTransferError: connection failure, vanished peer, or timeout.
        """
        return self._fetcher.fetch(src_rank, metadata, step, timeout)

    def recv_checkpoint_striped(
        self, sources: Sequence[Tuple[int, str]], step: int, timeout: timedelta
    ) -> T:
        """Fetches the checkpoint for ``step`` from every source at once, each serving
        disjoint byte ranges (ft/checkpointing/striped.py). ``sources`` are (rank, metadata)
        pairs, the assigned source first; the others need not serve ``step`` (they are
        skipped after ``StripeOptions.helper_wait_s``). A source that fails mid-heal is
        dropped and the others take its ranges; every source must hold the same bytes.

        Raises what :meth:`recv_checkpoint` raises; CheckpointTransferError names every
        source's failure when none is left.
        """
        return self._fetcher.fetch_striped(sources, step, timeout, self._stripe)

    @property
    def last_served(self) -> Dict[str, int]:
        """Bytes the last striped receive took from each source, by its metadata."""
        return dict(self._fetcher.last_served)

    @property
    def served_bytes(self) -> int:
        """Data bytes this source has sent over HTTP (completed ranges, all steps)."""
        return self._served.served_bytes

    def shutdown(self, wait: bool = True) -> None:
        if not self._checkpoints.stop():
            return
        join_s = min(_SHUTDOWN_JOIN_S, self._served.timeout_s)
        if self._same_host_source is not None:
            self._same_host_source.close(join_s if wait else 0.0)
        if wait:
            self._checkpoints.join(Deadline.after(join_s))
        self._served.forget()

    def __enter__(self) -> "HTTPTransport[T]":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ seams

    def _pace(self) -> None:
        """Called once per 1 MiB slice the source serves, on either path (a seam for tests
        that slow the source down)."""

    @property
    def _staging(self) -> Optional[Staging]:
        """The checkpoint staged now (tests inspect its leases and transfers)."""
        return self._served.staging

    @property
    def _open(self) -> Callable[..., Any]:
        """The receiver's request opener (a seam: tests wrap it to see the requests sent)."""
        return self._fetcher.open

    @_open.setter
    def _open(self, fn: Callable[..., Any]) -> None:
        self._fetcher.open = fn  # type: ignore[method-assign]
