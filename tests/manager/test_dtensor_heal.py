"""The Manager heals DTensor state: in-process, two replica groups of one rank each (one
Manager per thread, real lighthouse, ManagerServers and HTTP transport).

Each group's state is one DTensor on a (dp_replicate=2, dp_shard=2) mesh built without any
process group (``DeviceMesh(..., _init_backend=False, _rank=r)`` puts the thread's group at a
chosen coordinate), so the heal moves real DTensor pieces with no collective involved. At step 0
``init_sync`` makes one group heal from the other.
"""

from __future__ import annotations

import threading

from typing import Any, Dict, List, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ft.checkpointing.transport import CheckpointFormatError
from tests.manager.inproc import in_threads, lighthouse, replica_managers, values

PLACEMENTS = (Replicate(), Shard(0))
FULL = torch.arange(30.0).view(5, 6)


def mesh(coord: Sequence[int]) -> DeviceMesh:
    ranks = torch.arange(4).view(2, 2)
    return DeviceMesh(
        "cpu",
        ranks,
        mesh_dim_names=("dp_replicate", "dp_shard"),
        _init_backend=False,
        _rank=coord[0] * 2 + coord[1],
    )


def piece(full: torch.Tensor, m: DeviceMesh) -> DTensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, m, list(PLACEMENTS))
    local = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].clone()
    return DTensor.from_local(
        local, m, list(PLACEMENTS), run_check=False, shape=full.shape, stride=full.stride()
    )


def heal_once(meshes: List[DeviceMesh], async_quorum: bool = False) -> List[Dict[str, Any]]:
    """Both groups start at step 0 with their own DTensor (group i holds FULL * (i + 1)); one
    heals from the other. Returns, per group: what it loaded, its error, step and commit, and
    the threads its state_dict function was called on."""
    lh = lighthouse(min_replicas=2)
    states = [{"w": piece(FULL * (i + 1), meshes[i])} for i in range(2)]
    loaded: List[List[Any]] = [[], []]
    callers: List[List[threading.Thread]] = [[], []]

    def state_dict(i: int) -> Dict[str, Any]:
        callers[i].append(threading.current_thread())
        return states[i]

    def load(i: int, sd: Dict[str, Any]) -> None:
        loaded[i].append(sd)
        states[i]["w"].to_local().copy_(sd["w"].to_local())

    def own(i: int) -> Dict[str, Any]:
        return dict(load_state_dict=lambda sd: load(i, sd), state_dict=lambda: state_dict(i))

    ms = replica_managers(lh.address(), 2, own, use_async_quorum=async_quorum)

    def step(i: int) -> Dict[str, Any]:
        m = ms[i]
        callers[i].clear()
        m.start_quorum()  # sync: the heal is received and applied here
        error = m.errored()
        # as in training, the step's allreduce comes before the vote: the source keeps its
        # checkpoint staged until should_commit, and the healer joins the allreduce after
        m.allreduce(torch.ones(2)).wait()
        committed = m.should_commit()
        return {
            "loaded": loaded[i],
            "error": error,
            "step": m.current_step(),
            "committed": committed,
            "state": states[i]["w"],
            "step_thread": threading.current_thread(),
            "state_dict_threads": list(callers[i]),
        }

    try:
        return values(in_threads([lambda i=i: step(i) for i in range(2)]))
    finally:
        in_threads([lambda m=m: m.shutdown() for m in ms])
        lh.shutdown()


def test_heal_gives_dtensors_on_the_receivers_own_mesh() -> None:
    # Same shard (dp_shard coordinate 1), different replica rows: a valid heal.
    meshes = [mesh((0, 1)), mesh((1, 1))]
    out = heal_once(meshes)
    healers = [i for i in range(2) if out[i]["loaded"]]
    assert len(healers) == 1, out
    i = healers[0]
    got = out[i]["loaded"][0]["w"]
    assert type(got) is DTensor and got.device_mesh is meshes[i]
    assert tuple(got.placements) == PLACEMENTS
    source = piece(FULL * (2 - i), meshes[1 - i])  # the other group's piece, as it was
    assert torch.equal(got.to_local(), source.to_local())
    assert torch.equal(out[i]["state"].to_local(), out[1 - i]["state"].to_local())
    assert all(o["error"] is None and o["committed"] and o["step"] == 1 for o in out), out


def test_a_shard_mismatch_fails_the_heal_naming_the_key() -> None:
    # Group 0 holds shard 0, group 1 shard 1: whichever heals must refuse the other's piece.
    out = heal_once([mesh((0, 0)), mesh((1, 1))])
    failed = [o for o in out if o["error"] is not None]
    assert len(failed) == 1, out
    err, o = failed[0]["error"], failed[0]
    assert isinstance(err, CheckpointFormatError), repr(err)
    assert "state_dict['default']['w']: shard mismatch on mesh dimension 'dp_shard'" in str(err)
    assert o["loaded"] == []  # nothing was loaded
    assert not o["committed"] and o["step"] == 0  # the source's step was not taken either


def test_async_heal_reads_the_receivers_own_state_on_its_training_thread() -> None:
    """With the async quorum the heal is received on the quorum thread, but the DTensors are
    rebuilt against the receiver's own state when it is applied, on the thread that trains:
    reading it on the quorum thread would race a forward pass (FSDP swaps the parameters
    there)."""
    meshes = [mesh((0, 1)), mesh((1, 1))]
    out = heal_once(meshes, async_quorum=True)
    healers = [i for i in range(2) if out[i]["loaded"]]
    assert len(healers) == 1, out
    i = healers[0]
    assert type(out[i]["loaded"][0]["w"]) is DTensor
    assert out[i]["state_dict_threads"], "the receiver's state was never read for the check"
    assert all(t is out[i]["step_thread"] for t in out[i]["state_dict_threads"]), out[i]
    assert torch.equal(out[i]["state"].to_local(), out[1 - i]["state"].to_local())
