"""``ft.DistributedSampler``: shards a dataset across replica groups and the ranks inside them.

Every (replica group, group rank) pair reads a distinct shard: global rank =
``group_rank + num_replicas * replica_rank`` out of ``num_replicas * num_replica_groups``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch.distributed as dist
from torch.utils import data

__all__ = ["DistributedSampler"]


class DistributedSampler(data.distributed.DistributedSampler):
    """torchft's signature; ``kwargs`` (``shuffle``, ``seed``, ``drop_last``) go to torch's.

    Args:
        dataset: the dataset.
        replica_rank: this replica group's index (e.g. env ``REPLICA_GROUP_ID``).
        num_replica_groups: number of replica groups.
        group_rank: rank inside the group (default: ``dist.get_rank()`` or env ``RANK``).
        num_replicas: ranks per group (default: ``dist.get_world_size()`` or env
            ``WORLD_SIZE``).
    """

    def __init__(
        self,
        dataset: Any,
        replica_rank: int,
        num_replica_groups: int,
        group_rank: Optional[int] = None,
        num_replicas: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        if group_rank is None:
            group_rank = dist.get_rank() if initialized else int(os.environ.get("RANK", "0"))
        if num_replicas is None:
            num_replicas = (
                dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", "1"))
            )
        if not 0 <= replica_rank < num_replica_groups:
            raise ValueError(
                f"replica_rank {replica_rank} out of range for {num_replica_groups} groups"
            )
        self.global_rank = group_rank + num_replicas * replica_rank
        self.global_world_size = num_replicas * num_replica_groups
        super().__init__(
            dataset, num_replicas=self.global_world_size, rank=self.global_rank, **kwargs
        )
