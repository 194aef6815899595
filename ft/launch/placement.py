"""Which GPUs each replica group sees: ``ft-launch`` places groups on devices the way torchrun
places ranks on a node.

Contract:
* :func:`visible_gpus` is the launcher's own view: the entries of its ``CUDA_VISIBLE_DEVICES``
  (indices or UUIDs, as CUDA takes them) when set, else one index per GPU torch counts.
* :func:`place_groups` gives every group a slice of those GPUs, exported to each of its ranks as
  ``CUDA_VISIBLE_DEVICES``; a rank's ``LOCAL_RANK`` is its rank within the group, so a script
  that takes ``cuda:LOCAL_RANK`` (or ``LOCAL_RANK % device_count()``) lands on its group's
  slice. By default the GPUs are split evenly, ``len(gpus) // groups`` each; with fewer GPUs
  than groups each group gets one and groups share (round robin).
  ``gpus_per_group`` sets the slice; slices that run past the end wrap around, so groups share.
* Pure: data in, data out. A placement with no GPUs is the CPU placement: nothing is exported.
* :func:`sharing_notes` says, in words, who shares what: groups on one GPU (their cross-group
  collectives cannot use NCCL there; the ft backend carries them host-staged over Gloo) and
  ranks of one group on one GPU.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class GroupDevices:
    """The GPUs one replica group's ranks see."""

    gid: int
    """The replica group."""
    devices: Tuple[str, ...]
    """Its ``CUDA_VISIBLE_DEVICES`` entries, in order; empty on a CPU placement."""

    def env_value(self) -> Optional[str]:
        """What the group's ranks get as ``CUDA_VISIBLE_DEVICES``; None: leave it alone."""
        return ",".join(self.devices) if self.devices else None

    def label(self) -> str:
        """Short form for the status table: ``0,1`` or ``cpu``."""
        return ",".join(self.devices) if self.devices else "cpu"


def visible_gpus(env: Mapping[str, str], count: Callable[[], int]) -> List[str]:
    """The GPUs the launcher may hand out: its ``CUDA_VISIBLE_DEVICES`` entries when set
    (an empty value hides every GPU, as in CUDA), else ``count()`` indices."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return [entry.strip() for entry in value.split(",") if entry.strip()]
    return [str(index) for index in range(count())]


def nvml_gpu_count() -> int:
    """GPUs the NVIDIA driver shows this process (NVML; 0 without a driver).

    Why NVML and not torch: the launcher does not import torch (a second or two at every
    start), and counting through the CUDA runtime would also create a CUDA context in the
    launcher. NVML ignores ``CUDA_VISIBLE_DEVICES``; :func:`visible_gpus` honours it first.
    """
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    count = ctypes.c_uint(0)
    try:
        if nvml.nvmlInit_v2() != 0:
            return 0
        try:
            if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
                return 0
        finally:
            nvml.nvmlShutdown()
    except AttributeError:  # a library without these entry points
        return 0
    return int(count.value)


def parse_gpus(text: str) -> List[str]:
    """``--gpus``: a comma-separated list (``0,1,3`` or UUIDs), or ``none`` for CPU only."""
    if text.strip().lower() in ("none", "cpu", ""):
        return []
    entries = [entry.strip() for entry in text.split(",")]
    if any(not entry for entry in entries):
        raise ValueError(f"--gpus {text!r}: an empty entry")
    if len(set(entries)) != len(entries):
        raise ValueError(f"--gpus {text!r}: a GPU is listed twice")
    return entries


def place_groups(
    gpus: Sequence[str], num_groups: int, gpus_per_group: Optional[int] = None
) -> List[GroupDevices]:
    """Every group's slice of ``gpus`` (see the module's contract)."""
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    if not gpus:
        if gpus_per_group:
            raise ValueError(f"--gpus-per-group {gpus_per_group} but no GPU is visible")
        return [GroupDevices(gid, ()) for gid in range(num_groups)]
    if gpus_per_group is None:
        per = max(1, len(gpus) // num_groups)
    elif gpus_per_group < 1:
        raise ValueError(f"--gpus-per-group must be >= 1, got {gpus_per_group}")
    elif gpus_per_group > len(gpus):
        raise ValueError(
            f"--gpus-per-group {gpus_per_group} but only {len(gpus)} GPU(s) visible "
            f"({','.join(gpus)})"
        )
    else:
        per = gpus_per_group
    return [
        GroupDevices(gid, tuple(gpus[(gid * per + i) % len(gpus)] for i in range(per)))
        for gid in range(num_groups)
    ]


def groups_by_gpu(placement: Sequence[GroupDevices]) -> Dict[str, List[int]]:
    """GPU -> the groups that see it, for GPUs seen by more than one group."""
    holders: Dict[str, List[int]] = {}
    for group in placement:
        for device in group.devices:
            holders.setdefault(device, []).append(group.gid)
    return {device: gids for device, gids in holders.items() if len(gids) > 1}


def sharing_notes(placement: Sequence[GroupDevices], ranks_per_group: int) -> List[str]:
    """One line per kind of sharing in ``placement``; empty when every rank has its own GPU."""
    notes = []
    shared = groups_by_gpu(placement)
    if shared:
        listed = "; ".join(
            f"GPU {device}: groups {', '.join(map(str, gids))}" for device, gids in shared.items()
        )
        notes.append(
            f"replica groups share GPUs ({listed}): NCCL cannot span one GPU twice, so the ft "
            "backend carries their cross-group collectives host-staged over Gloo (slower; "
            "give each group its own GPUs for full speed)"
        )
    slice_sizes = {len(group.devices) for group in placement if group.devices}
    if slice_sizes and ranks_per_group > min(slice_sizes):
        notes.append(
            f"{ranks_per_group} rank(s) per group on {min(slice_sizes)} GPU(s) per group: ranks "
            "of a group share GPUs"
        )
    return notes


def describe(placement: Sequence[GroupDevices]) -> str:
    """The placement for the start line: ``GPUs g0 [0] g1 [1]`` or ``on CPU``."""
    if not any(group.devices for group in placement):
        return "on CPU (no GPU visible)"
    return "GPUs " + " ".join(f"g{group.gid} [{group.label()}]" for group in placement)
