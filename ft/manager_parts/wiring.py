"""A replica group's links, as one rank of it holds them: made once when the Manager starts,
closed once when it shuts down (docs/design.md, "Roles").

Contract:
  * ``GroupWiring(...)`` makes, in this order: the advertised host (checked reachable from the
    lighthouse's side), the checkpoint transport (unless one was given) and its Healer, the
    group's store (rank 0 hosts it unless torchelastic's agent does, else connects within the
    connect timeout, naming a squatter on the port), then on rank 0 the ManagerServer and the
    published addresses (signed with a job secret), on the other ranks those addresses read
    back, the client of the group's server, and, where a lighthouse address is known, a
    lighthouse client subscribed to failure notifications. If any step raises, what was made
    is closed before the exception leaves.
  * ``close(wait)`` ends them in the order that keeps the lighthouse from mistaking a clean
    exit for a death: leave, unsubscribe, close the clients, the transport, the server.
  * Nothing here knows the step protocol; the Manager reads the links as attributes.
"""

from __future__ import annotations

import logging
import os
import uuid
from datetime import timedelta
from typing import Any, Callable, Dict, Optional

import torch.distributed as dist
from torch.distributed import TCPStore

from ft.backend.process_group import connect_store_client
from ft.checkpointing import CheckpointTransport, HTTPTransport
from ft.coordination import FailureNotification, LighthouseClient, ManagerServer
from ft.coordination.manager_server import LocalManagerClient
from ft.manager_parts.heal import Healer
from ft.protocols import GroupServerClient
from ft.utils import net
from ft.utils.auth import StoreValues, resolve_secret

__all__ = [
    "GroupWiring",
    "LIGHTHOUSE_ADDR_KEY",
    "MANAGER_ADDR_KEY",
    "MANAGER_PORT_ENV",
    "REPLICA_ID_KEY",
]

logger = logging.getLogger("ft.manager")

MANAGER_ADDR_KEY = "manager_addr"
REPLICA_ID_KEY = "replica_id"
# Group rank 0 publishes the lighthouse address here, so that the other ranks of the group need
# no TORCHFT_LIGHTHOUSE (as in torchft, where only rank 0 reads it).
LIGHTHOUSE_ADDR_KEY = "lighthouse_addr"
MANAGER_PORT_ENV = "TORCHFT_MANAGER_PORT"


class GroupWiring:
    """The links of one rank of a replica group (module docstring)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        replica_name: str,
        lighthouse_addr: Optional[str],
        store_addr: Optional[str],
        store_port: Optional[int],
        port: Optional[int],
        hostname: Optional[str],
        heartbeat_interval: timedelta,
        quorum_retries: Optional[int],
        timeout: timedelta,
        connect_timeout: timedelta,
        transport: Optional[CheckpointTransport[Dict[str, Any]]],
        client_factory: Callable[..., GroupServerClient],
        on_failure: Callable[[FailureNotification], None],
    ) -> None:
        """``client_factory``: makes the client of another rank's (or group's) ManagerServer
        (the Manager passes its module's ``ManagerClient``, the one name torchft's tests
        substitute). ``on_failure``: called for each failure notification."""
        self._rank = rank
        self._connect_timeout = connect_timeout
        self.replica_id = replica_name
        self.lighthouse_addr = lighthouse_addr
        self.healer: Optional[Healer] = None
        self.transport = transport
        self.store: Optional[dist.Store] = None
        self.store_addr = ""
        self.store_port = 0
        self.advertise_host = ""
        self.server: Optional[ManagerServer] = None
        self.client: Optional[GroupServerClient] = None
        self.lighthouse_client: Optional[LighthouseClient] = None
        self._subscription: Any = None
        try:
            store_addr = store_addr or os.environ.get("MASTER_ADDR") or "localhost"
            hostname = self._advertise(hostname, store_addr)
            if self.transport is None:
                self.transport = HTTPTransport(
                    timeout=timeout,
                    num_chunks=0,
                    advertise_host=hostname,
                    bind_host=net.bind_host_for(hostname).strip("[]"),
                )
            # The heal source's client comes from the same factory, as in torchft: one name
            # to substitute for every ManagerServer the Manager talks to.
            self.healer = Healer(self.transport, connect_timeout, client_factory=client_factory)
            prefixed, sealed = self._open_store(store_addr, store_port, world_size)
            if rank == 0:
                addr = self._serve(
                    prefixed, sealed, hostname, port, world_size, heartbeat_interval,
                    quorum_retries,
                )  # fmt: skip
            else:
                addr = self._read_published(prefixed, sealed)
            self._connect_clients(addr, client_factory, on_failure)
        except BaseException:
            self.close(wait=False)
            raise

    @property
    def transport(self) -> Optional[CheckpointTransport[Dict[str, Any]]]:
        """The checkpoint transport heals go through; one assigned later (torchft's tests
        replace it) goes to the Healer too, so the next heal uses it and ``close`` ends it."""
        return self._transport

    @transport.setter
    def transport(self, transport: Optional[CheckpointTransport[Dict[str, Any]]]) -> None:
        self._transport = transport
        if self.healer is not None and transport is not None:
            self.healer.transport = transport

    def _connect_clients(
        self,
        addr: str,
        client_factory: Callable[..., GroupServerClient],
        on_failure: Callable[[FailureNotification], None],
    ) -> None:
        """The client of the group's ManagerServer at ``addr``, and the lighthouse's."""
        # Rank 0 hosts the ManagerServer and calls it directly (no loopback gRPC per step).
        self.client = (
            LocalManagerClient(self.server)
            if self.server is not None
            # Signs only for the server that proves it serves this replica (docs/security.md).
            else client_factory(
                addr, connect_timeout=self._connect_timeout, replica_id=self.replica_id
            )
        )
        if not self.lighthouse_addr:
            # Without a lighthouse address (a group rank other than 0, given none, whose rank
            # 0 published none) this rank learns of failures from its own ops' errors only.
            return
        self.lighthouse_client = LighthouseClient(
            self.lighthouse_addr, connect_timeout=self._connect_timeout
        )
        self._subscription = self.lighthouse_client.subscribe_failures(
            on_failure, subscriber=f"{self.replica_id}/{self._rank}"
        )

    def _advertise(self, hostname: Optional[str], store_addr: str) -> str:
        """The host peers reach this rank at: checked reachable from the lighthouse's side (or,
        for a group rank other than 0 given no lighthouse address, the store's)."""
        if self.lighthouse_addr:
            peer_host, _ = net.split_hostport(self.lighthouse_addr)
        else:
            peer_host = store_addr
        if hostname is None:
            hostname = net.advertise_host(toward=peer_host)
        net.check_reachable_advertisement(hostname, peer_host, f"replica {self.replica_id!r}")
        if not os.environ.get(net.ADVERTISE_ENV):
            # The checkpoint transport, the store address and Gloo advertise the same host.
            net.set_process_advertise_host(hostname)
        self.advertise_host = hostname
        return hostname

    def _open_store(
        self, store_addr: str, store_port: Optional[int], world_size: int
    ) -> "tuple[dist.Store, StoreValues]":
        """Hosts (rank 0) or connects to the group's store; returns the store the Manager's
        keys live in and the sealing of what is written there."""
        if store_port is None:
            env_port = os.environ.get("MASTER_PORT")
            if env_port is None and world_size > 1:
                raise ValueError("store_port is required (or set MASTER_PORT)")
            store_port = int(env_port) if env_port is not None else 0
        store_timeout = timedelta(seconds=max(self._connect_timeout.total_seconds(), 1.0))
        use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store: Optional[TCPStore] = None
        host_error: Optional[Exception] = None
        if self._rank == 0 and not use_agent_store:
            try:
                store = TCPStore(
                    store_addr,
                    store_port,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=store_timeout,
                )
            except Exception as e:
                if store_port == 0:
                    raise
                # Another process may host it (a launcher's agent); if what listens there is
                # not a store, the bounded connect below says so instead of waiting on it.
                host_error = e
                logger.warning(
                    "could not host the store on port %d (%s); connecting to it", store_port, e
                )
        if store is None:
            try:
                store = connect_store_client(store_addr, store_port, store_timeout)
            except dist.DistStoreError as e:
                if host_error is None:
                    raise
                raise dist.DistStoreError(
                    f"rank 0 could not host the group's store on {store_addr}:{store_port} "
                    f"({host_error}), and what listens there is not a store that answers ({e}): "
                    "another program holds the port; give the group a free MASTER_PORT"
                ) from e
        self.store = store
        self.store_addr = store_addr
        self.store_port = store.port
        # First attempt: torchft's keys at the store's root. A torchelastic restart reuses the
        # agent's store, so each later attempt has its own prefix and never reads the keys of
        # the attempt before it.
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
        prefixed = (
            store if restart == "0" else dist.PrefixStore(f"torchft/manager/{restart}", store)
        )
        # With a job secret, what ft writes here is signed for this store and attempt, and
        # checked on read (the store authenticates no one; ft.utils.auth.StoreValues).
        sealed = StoreValues(
            resolve_secret(), f"{net.join_hostport(store_addr, self.store_port)}/{restart}"
        )
        return prefixed, sealed

    def _serve(
        self,
        prefixed: dist.Store,
        sealed: StoreValues,
        hostname: str,
        port: Optional[int],
        world_size: int,
        heartbeat_interval: timedelta,
        quorum_retries: Optional[int],
    ) -> str:
        """Rank 0: names the replica, starts its ManagerServer and publishes the addresses the
        other ranks read; returns the server's address."""
        name = self.replica_id or os.environ.get("REPLICA_GROUP_ID") or "replica"
        self.replica_id = f"{name}:{uuid.uuid4()}"
        if port is None:
            port = int(os.environ.get(MANAGER_PORT_ENV, "0"))
        self.server = ManagerServer(
            replica_id=self.replica_id,
            lighthouse_addr=self.lighthouse_addr,
            hostname=hostname,
            bind=f"{net.bind_host_for(hostname)}:{port}",
            # Other groups dial the primary's store: a loopback MASTER_ADDR is advertised as
            # this replica's host (the store server listens on every interface).
            store_addr=net.join_hostport(
                hostname if net.is_loopback(self.store_addr) else self.store_addr,
                self.store_port,
            ),
            world_size=world_size,
            heartbeat_interval=heartbeat_interval,
            connect_timeout=self._connect_timeout,
            quorum_retries=quorum_retries,
        )
        assert self.lighthouse_addr is not None
        for key, value in (
            (LIGHTHOUSE_ADDR_KEY, self.lighthouse_addr),  # before the address
            (MANAGER_ADDR_KEY, self.server.address()),
            (REPLICA_ID_KEY, self.replica_id),
        ):
            prefixed.set(key, sealed.seal(key, value))
        return self.server.address()

    def _read_published(self, prefixed: dist.Store, sealed: StoreValues) -> str:
        """A rank other than 0: the addresses rank 0 published (checked against the secret);
        returns the ManagerServer's."""
        addr = sealed.open(MANAGER_ADDR_KEY, prefixed.get(MANAGER_ADDR_KEY)).decode()
        self.replica_id = sealed.open(REPLICA_ID_KEY, prefixed.get(REPLICA_ID_KEY)).decode()
        if not self.lighthouse_addr and prefixed.check([LIGHTHOUSE_ADDR_KEY]):
            self.lighthouse_addr = sealed.open(
                LIGHTHOUSE_ADDR_KEY, prefixed.get(LIGHTHOUSE_ADDR_KEY)
            ).decode()
        return addr

    def close(self, wait: bool) -> None:
        """Ends every link made (module docstring); safe to call twice."""
        if self.server is not None:
            # Before the subscription ends: a dropped subscription reads as this replica's death.
            self.server.leave()
        if self._subscription is not None:
            self._subscription.close(timeout=2.0 if wait else 0.5)
            self._subscription = None
        if self.lighthouse_client is not None:
            self.lighthouse_client.close()
            self.lighthouse_client = None
        try:
            if self.transport is not None:
                self.transport.shutdown(wait=wait)
        except Exception:  # noqa: BLE001
            logger.exception("checkpoint transport shutdown failed")
        if self.server is not None:
            self.server.shutdown()
            self.server = None
        if self.client is not None:
            self.client.close()
        if self.healer is not None:
            self.healer.close()
