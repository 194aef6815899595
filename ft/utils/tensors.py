"""Tensor-tree helpers shared by the algorithms (imports torch: not for the torch-free
control plane, which never imports this module)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_state"]


def clone_state(obj: Any) -> Any:
    """A copy of a state tree that shares no tensor memory with it: tensors are detached and
    cloned, dicts, lists and tuples rebuilt, and every other leaf (numbers, strings, dtypes)
    kept as it is. Use it to snapshot state that the caller goes on mutating in place."""
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_state(v) for v in obj)
    return obj
