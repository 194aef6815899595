"""The Manager's settings as its arguments and the environment give them (torchft's variables
win over the keywords, as in torchft).

Contract: :meth:`ManagerSettings.resolve` raises ValueError naming the setting for a rank out
of range, a missing lighthouse address on group rank 0, or ``min_replica_size < 1``; nothing
is started before it returns.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any, Dict, Mapping, Optional

from ft.utils.deadline import to_timedelta

__all__ = [
    "CONNECT_TIMEOUT_SEC_ENV",
    "LIGHTHOUSE_ENV",
    "ManagerSettings",
    "QUORUM_RETRIES_ENV",
    "QUORUM_TIMEOUT_SEC_ENV",
    "TIMEOUT_SEC_ENV",
    "get_timeout",
]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
TIMEOUT_SEC_ENV = "TORCHFT_TIMEOUT_SEC"
QUORUM_TIMEOUT_SEC_ENV = "TORCHFT_QUORUM_TIMEOUT_SEC"
CONNECT_TIMEOUT_SEC_ENV = "TORCHFT_CONNECT_TIMEOUT_SEC"
QUORUM_RETRIES_ENV = "TORCHFT_QUORUM_RETRIES"


def get_timeout(timeout_sec_env: Optional[str], default_timeout_sec: timedelta) -> timedelta:
    """torchft's helper: ``timeout_sec_env`` is the *value* of a seconds variable (e.g.
    ``os.environ.get("TORCHFT_TIMEOUT_SEC")``); None or empty gives ``default_timeout_sec``.

    torchft parses the value with ``int``; ft also accepts fractional seconds ("1.5").
    """
    if timeout_sec_env is None or str(timeout_sec_env).strip() == "":
        return default_timeout_sec
    try:
        return timedelta(seconds=float(timeout_sec_env))
    except ValueError:
        raise ValueError(f"a timeout in seconds was expected, got {timeout_sec_env!r}") from None


@dataclasses.dataclass(frozen=True)
class ManagerSettings:
    """What the Manager's keywords and the environment settle (Manager's docstring says what
    each means)."""

    rank: int
    """This rank in its replica group (env ``RANK``)."""
    world_size: int
    """The replica group's size (env ``WORLD_SIZE``)."""
    timeout: timedelta
    """Collectives, checkpoint transfers and the vote (env ``TORCHFT_TIMEOUT_SEC``)."""
    quorum_timeout: timedelta
    """One quorum (env ``TORCHFT_QUORUM_TIMEOUT_SEC``)."""
    connect_timeout: timedelta
    """Connecting to the lighthouse, the ManagerServer and the store
    (env ``TORCHFT_CONNECT_TIMEOUT_SEC``)."""
    lighthouse_addr: Optional[str]
    """The lighthouse (env ``TORCHFT_LIGHTHOUSE``); other group ranks may take it from rank 0."""
    quorum_retries: Optional[int]
    """Extra lighthouse attempts per quorum (env ``TORCHFT_QUORUM_RETRIES``)."""

    @classmethod
    def resolve(
        cls,
        min_replica_size: int,
        timeout: Any,
        quorum_timeout: Any,
        connect_timeout: Any,
        rank: Optional[int],
        world_size: Optional[int],
        lighthouse_addr: Optional[str],
        quorum_retries: Optional[int],
        env: Optional[Mapping[str, str]] = None,
    ) -> "ManagerSettings":
        """``env``: default ``os.environ`` as it is at the call (torchft's tests patch it)."""
        env = os.environ if env is None else env
        if min_replica_size < 1:
            raise ValueError(f"min_replica_size must be >= 1, got {min_replica_size}")

        def seconds(name: str, given: Any) -> timedelta:
            return get_timeout(env.get(name), to_timedelta(given))

        settings = cls(
            rank=int(rank if rank is not None else env.get("RANK", "0")),
            world_size=int(world_size if world_size is not None else env.get("WORLD_SIZE", "1")),
            timeout=seconds(TIMEOUT_SEC_ENV, timeout),
            quorum_timeout=seconds(QUORUM_TIMEOUT_SEC_ENV, quorum_timeout),
            connect_timeout=seconds(CONNECT_TIMEOUT_SEC_ENV, connect_timeout),
            lighthouse_addr=lighthouse_addr or env.get(LIGHTHOUSE_ENV) or None,
            quorum_retries=(
                int(env[QUORUM_RETRIES_ENV]) if env.get(QUORUM_RETRIES_ENV) else quorum_retries
            ),
        )
        if not 0 <= settings.rank < settings.world_size:
            raise ValueError(
                f"rank {settings.rank} out of range for world_size {settings.world_size}"
            )
        if not settings.lighthouse_addr and settings.rank == 0:
            raise ValueError(f"lighthouse_addr is required (or set {LIGHTHOUSE_ENV})")
        return settings

    def wiring(self) -> Dict[str, Any]:
        """The keywords of GroupWiring these settle."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "lighthouse_addr": self.lighthouse_addr,
            "quorum_retries": self.quorum_retries,
            "timeout": self.timeout,
            "connect_timeout": self.connect_timeout,
        }
