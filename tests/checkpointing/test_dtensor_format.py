"""DTensors in the checkpoint format: exact round trips onto the receiver's own mesh, and a
clear CheckpointFormatError naming the key for every mismatch (never a redistribution).

Meshes here are built without any process group: ``DeviceMesh(..., _init_backend=False,
_rank=r)`` puts this process at rank ``r`` of the mesh, so one test process can play the sender
at one coordinate and the receiver at another. DTensors are made with ``from_local`` (no
communication); nothing here runs a collective.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ft.checkpointing import HTTPTransport
from ft.checkpointing import serialization as ser
from ft.checkpointing.dtensor_codec import ReceivedDTensor, restore_dtensors
from ft.checkpointing.transport import CheckpointFormatError

NAMES_2D = ("dp_replicate", "dp_shard")


def mesh(
    coord: Sequence[int], shape: Sequence[int] = (2, 2), names: Optional[Tuple[str, ...]] = NAMES_2D
) -> DeviceMesh:
    """A CPU mesh of ``shape`` seen from the rank at ``coord`` (no process group needed)."""
    rank = 0
    for c, n in zip(coord, shape):
        rank = rank * n + c
    ranks = torch.arange(int(torch.tensor(shape).prod())).view(*shape)
    return DeviceMesh("cpu", ranks, mesh_dim_names=names, _init_backend=False, _rank=rank)


def chunk(full: torch.Tensor, m: DeviceMesh, placements: Sequence[Any]) -> torch.Tensor:
    """This coordinate's piece of ``full`` (torch's chunking rules)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, m, list(placements))
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return full[index].clone()


def dtensor(
    full: torch.Tensor,
    m: DeviceMesh,
    placements: Sequence[Any],
    local: Optional[torch.Tensor] = None,
) -> DTensor:
    local = chunk(full, m, placements) if local is None else local
    return DTensor.from_local(
        local, m, list(placements), run_check=False, shape=full.shape, stride=full.stride()
    )


def transfer(state: Any) -> Any:
    """flatten -> JSON header -> bytes -> unflatten, as a transport moves them."""
    tree, specs, tensors = ser.flatten(state)
    header = ser.encode_header(tree, specs)
    assert b"pickle" not in header
    _, tree2, specs2 = ser.decode_header(header)
    out: List[torch.Tensor] = []
    for t, s in zip(tensors, specs2):
        r = ser.allocate(s, torch.device("cpu"))
        if r.numel():
            ser.memview(r)[:] = ser.memview(t)
        out.append(ser.finalize(r, s))
    return ser.unflatten(tree2, out)


def heal(sent: Any, reference: Any) -> Any:
    return restore_dtensors(transfer(sent), lambda: reference)


FULL = torch.arange(5 * 6, dtype=torch.float32).view(5, 6) / 7  # 5 rows: uneven over 2


# ----------------------------------------------------------------------------- round trips

ROUND_TRIPS = {
    # name: (placements, sender coord, receiver coord, mesh shape, names)
    "hsdp: Replicate x Shard(0), other replica row": (
        (Replicate(), Shard(0)),
        (1, 1),
        (0, 1),
        (2, 2),
        NAMES_2D,
    ),
    "hsdp: uneven shard 0 of 2": ((Replicate(), Shard(0)), (1, 0), (0, 0), (2, 2), NAMES_2D),
    "replicated everywhere": ((Replicate(), Replicate()), (1, 0), (0, 1), (2, 2), NAMES_2D),
    "two sharded dims": ((Shard(1), Shard(0)), (1, 1), (1, 1), (2, 2), NAMES_2D),
    "same dim sharded twice": ((Shard(0), Shard(0)), (0, 1), (0, 1), (2, 2), NAMES_2D),
    "partial sum on dp_shard": ((Replicate(), Partial("sum")), (1, 0), (0, 0), (2, 2), NAMES_2D),
    "strided shard (FSDP2 + TP)": (
        (_StridedShard(0, split_factor=2), Shard(0)),
        (0, 1),
        (0, 1),
        (2, 2),
        ("dp", "tp"),
    ),
    "1-D mesh, no names": ((Shard(1),), (2,), (2,), (3,), None),
}


@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_dtensor_round_trips_onto_the_receivers_mesh(case: str) -> None:
    placements, src, dst, shape, names = ROUND_TRIPS[case]
    sent = dtensor(FULL, mesh(src, shape, names), placements)
    mine = mesh(dst, shape, names)
    ref = dtensor(torch.zeros_like(FULL), mine, placements)
    got = heal({"w": sent}, {"w": ref})["w"]
    assert type(got) is DTensor
    assert got.device_mesh is mine  # the receiver's own mesh object
    assert tuple(got.placements) == tuple(sent.placements)
    assert got.shape == FULL.shape and got.stride() == FULL.stride()
    assert torch.equal(got.to_local(), sent.to_local())  # bitwise, as sent


def test_a_replicate_dims_size_may_differ() -> None:
    # ft's replicate dimension has a nominal size; groups may give it differently. The piece
    # a rank holds does not depend on it.
    sent = dtensor(FULL, mesh((2, 1), shape=(3, 2)), (Replicate(), Shard(0)))
    mine = mesh((0, 1))
    got = heal({"w": sent}, {"w": dtensor(torch.zeros_like(FULL), mine, (Replicate(), Shard(0)))})
    assert got["w"].device_mesh is mine and torch.equal(got["w"].to_local(), sent.to_local())


def test_received_form_before_restoring_and_header_is_json() -> None:
    sent = dtensor(FULL, mesh((1, 1)), (Replicate(), Shard(0)))
    tree, specs, tensors = ser.flatten({"w": sent})
    doc = json.loads(ser.encode_header(tree, specs))
    node = doc["tree"][1][0][1]
    assert node[0] == "DT" and node[2]["placements"] == [["R"], ["S", 0]]
    assert node[2]["mesh"] == {
        "device": "cpu",
        "shape": [2, 2],
        "names": list(NAMES_2D),
        "coord": [1, 1],
    }
    assert doc["tensors"][node[1]]["shape"] == [2, 6]  # only the local piece travels
    assert tensors[node[1]] is sent.to_local() or torch.equal(tensors[node[1]], sent.to_local())
    leaf = transfer({"w": sent})["w"]
    assert isinstance(leaf, ReceivedDTensor) and leaf.mesh.coord == (1, 1)


def test_parameter_flag_noncontiguous_local_and_dtype_survive() -> None:
    m_src, m_dst = mesh((1, 0)), mesh((0, 0))
    full = torch.randn(4, 6, dtype=torch.bfloat16)
    local = chunk(full, m_src, (Replicate(), Shard(1))).t().contiguous().t()  # column-major
    p = torch.nn.Parameter(dtensor(full, m_src, (Replicate(), Shard(1)), local=local))
    ref = torch.nn.Parameter(dtensor(torch.zeros_like(full), m_dst, (Replicate(), Shard(1))))
    got = heal({"p": p}, {"p": ref})["p"]
    assert isinstance(got, torch.nn.Parameter) and got.requires_grad
    assert got.dtype == torch.bfloat16 and got.to_local().stride() == local.stride()
    assert torch.equal(got.to_local(), local)


def test_optimizer_state_without_a_counterpart_uses_a_mesh_of_the_receivers_state() -> None:
    # A restarted replica's optimizer has no state yet: its model's mesh is used.
    src, mine = mesh((1, 1)), mesh((0, 1))
    pl = (Replicate(), Shard(0))
    sent = {
        "model": {"w": dtensor(FULL, src, pl)},
        "optim": {
            "state": {0: {"exp_avg": dtensor(FULL * 2, src, pl), "step": torch.tensor(3.0)}},
            "param_groups": [{"params": [0], "lr": 0.1}],
        },
    }
    ref = {
        "model": {"w": dtensor(torch.zeros_like(FULL), mine, pl)},
        "optim": {"state": {}, "param_groups": [{"params": [0], "lr": 0.1}]},
    }
    got = heal(sent, ref)
    avg = got["optim"]["state"][0]["exp_avg"]
    assert type(avg) is DTensor and avg.device_mesh is mine
    assert torch.equal(avg.to_local(), sent["optim"]["state"][0]["exp_avg"].to_local())
    assert torch.equal(got["optim"]["state"][0]["step"], torch.tensor(3.0))


def test_one_dtensor_under_two_keys_stays_one_object() -> None:
    src, mine = mesh((0, 1)), mesh((1, 1))
    pl = (Replicate(), Shard(0))
    w = dtensor(FULL, src, pl)
    ref = dtensor(torch.zeros_like(FULL), mine, pl)
    got = heal({"a": w, "b": [w], "local": w.to_local()}, {"a": ref, "b": [ref]})
    assert got["a"] is got["b"][0]
    assert torch.equal(got["local"], w.to_local())


def test_state_without_dtensors_never_asks_for_the_reference() -> None:
    def boom() -> Any:
        raise AssertionError("reference read without a DTensor in the state")

    state = transfer({"w": torch.ones(2)})
    assert restore_dtensors(state, boom) is state


def test_transport_moves_dtensor_pieces_in_checked_parallel_ranges() -> None:
    # The local tensors are ordinary tensors of the checkpoint: CRC-checked byte ranges.
    src, mine = mesh((1, 0)), mesh((0, 0))
    pl = (Replicate(), Shard(0))
    big = torch.randn(64, 1024)
    sent = {"w": dtensor(big, src, pl), "b": dtensor(FULL, src, pl)}
    ref = {
        "w": dtensor(torch.zeros_like(big), mine, pl),
        "b": dtensor(torch.zeros_like(FULL), mine, pl),
    }
    to = timedelta(seconds=10)
    kw = dict(advertise_host="127.0.0.1", same_host=False)
    with HTTPTransport(to, 4, **kw) as source, HTTPTransport(to, 4, **kw) as dest:
        source.send_checkpoint([1], 3, sent, to)
        received = dest.recv_checkpoint(0, source.metadata(), 3, to)
    got = restore_dtensors(received, lambda: ref)
    for k in sent:
        assert torch.equal(got[k].to_local(), sent[k].to_local())
        assert got[k].device_mesh is mine


def test_pg_transport_never_receives_a_dtensor_piece_in_place() -> None:
    # PGTransport receives plain tensors straight into the receiver's own (template) tensors;
    # a DTensor's piece must not be written anywhere before restore_dtensors has checked it.
    import threading

    import torch.distributed as dist
    from tests.checkpointing.ckpt_testlib import gloo_pg

    from ft.checkpointing import PGTransport
    from tests.manager.inproc import in_threads

    to = timedelta(seconds=10)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=to, wait_for_workers=False)
    pgs: Dict[int, Any] = {}

    def make(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, 2, False, timeout=to)
        pgs[rank] = gloo_pg(client, rank, 2, to)

    makers = [threading.Thread(target=make, args=(r,), daemon=True) for r in (0, 1)]
    for t in makers:
        t.start()
    for t in makers:
        t.join(30)
    assert len(pgs) == 2, "process group construction timed out"
    try:
        src, mine = mesh((1, 1)), mesh((0, 1))
        pl = (Replicate(), Shard(0))
        sent = {"w": dtensor(FULL, src, pl), "plain": torch.arange(4.0)}
        template = {"w": dtensor(torch.zeros_like(FULL), mine, pl), "plain": torch.zeros(4)}
        before = template["w"].to_local().clone()
        send = PGTransport(pgs[0], to, torch.device("cpu"))
        recv = PGTransport(pgs[1], to, torch.device("cpu"), state_dict=lambda: template)
        outs = in_threads(
            [
                lambda: send.send_checkpoint([1], 2, sent, to),
                lambda: recv.recv_checkpoint(0, "<n/a>", 2, to),
            ]
        )
        assert "error" not in outs[0] and "error" not in outs[1], outs
        got = outs[1]["value"]
        assert got["plain"].data_ptr() == template["plain"].data_ptr()  # plain: in place
        assert torch.equal(template["w"].to_local(), before)  # the DTensor's piece: not
        restored = restore_dtensors(got, lambda: template)
        assert restored["w"].device_mesh is mine
        assert torch.equal(restored["w"].to_local(), sent["w"].to_local())
    finally:
        for pg in pgs.values():
            pg.shutdown()


# ----------------------------------------------------------------------------- mismatches


def _sender(
    pl: Sequence[Any], coord=(1, 1), shape=(2, 2), names=NAMES_2D, full: torch.Tensor = FULL
) -> DTensor:
    return dtensor(full, mesh(coord, shape, names), pl)


MISMATCHES = {
    # name: (what is sent, the receiver's reference at that key, message pattern)
    "shard rank": (
        lambda: _sender((Replicate(), Shard(0)), coord=(1, 0)),
        lambda: dtensor(torch.zeros_like(FULL), mesh((0, 1)), (Replicate(), Shard(0))),
        r"shard mismatch on mesh dimension 'dp_shard'.*coordinate 0.*coordinate 1",
    ),
    "partial rank": (
        lambda: _sender((Replicate(), Partial()), coord=(0, 1)),
        lambda: dtensor(torch.zeros_like(FULL), mesh((0, 0)), (Replicate(), Partial())),
        r"shard mismatch on mesh dimension 'dp_shard'",
    ),
    "shard dim": (
        lambda: _sender((Replicate(), Shard(0))),
        lambda: dtensor(torch.zeros_like(FULL), mesh((0, 1)), (Replicate(), Shard(1))),
        r"placement mismatch: the source sent \(Replicate\(\), Shard\(0\)\), this replica "
        r"holds \(Replicate\(\), Shard\(1\)\)",
    ),
    "replicate vs shard": (
        lambda: _sender((Replicate(), Replicate())),
        lambda: dtensor(torch.zeros_like(FULL), mesh((0, 1)), (Replicate(), Shard(0))),
        r"placement mismatch",
    ),
    "partial op": (
        lambda: _sender((Replicate(), Partial("sum")), coord=(0, 1)),
        lambda: dtensor(torch.zeros_like(FULL), mesh((0, 1)), (Replicate(), Partial("avg"))),
        r"placement mismatch.*Partial\('sum'\).*Partial\('avg'\)",
    ),
    "global shape": (
        lambda: _sender((Replicate(), Shard(0))),
        lambda: dtensor(torch.zeros(6, 6), mesh((0, 1)), (Replicate(), Shard(0))),
        r"global shape \[5, 6\], this replica's \[6, 6\]",
    ),
    "mesh dim names": (
        lambda: _sender((Replicate(), Shard(0))),
        lambda: dtensor(
            torch.zeros_like(FULL), mesh((0, 1), names=("a", "b")), (Replicate(), Shard(0))
        ),
        r"dp_replicate=2, dp_shard=2",
    ),
    "mesh size of a sharded dim": (
        lambda: _sender((Replicate(), Shard(0)), coord=(0, 1), shape=(2, 3)),
        lambda: dtensor(torch.zeros_like(FULL), mesh((0, 1)), (Replicate(), Shard(0))),
        r"dp_replicate=2, dp_shard=3",
    ),
    "plain tensor here": (
        lambda: _sender((Replicate(), Shard(0))),
        lambda: torch.zeros(3, 6),
        r"where this replica has Tensor",
    ),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatch_is_a_format_error_naming_the_key(case: str) -> None:
    make_sent, make_ref, pattern = MISMATCHES[case]
    with pytest.raises(CheckpointFormatError, match=pattern) as e:
        heal({"model": {"layer.weight": make_sent()}}, {"model": {"layer.weight": make_ref()}})
    assert "state_dict['model']['layer.weight']" in str(e.value)


def test_no_mesh_of_that_kind_on_the_receiver() -> None:
    sent = {"optim": {0: _sender((Replicate(), Shard(0)))}}
    ref = {"optim": {}, "model": {"w": torch.zeros(2)}}
    with pytest.raises(
        CheckpointFormatError,
        match=r"state_dict\['optim'\]\[0\]: .*no DTensor "
        r"of this replica's state is on such a mesh",
    ):
        heal(sent, ref)


def test_shard_rank_is_checked_without_a_counterpart_too() -> None:
    sent = {
        "model": {"w": _sender((Replicate(), Shard(0)), coord=(1, 1))},
        "optim": {0: _sender((Replicate(), Shard(0)), coord=(1, 0))},
    }
    ref = {
        "model": {"w": dtensor(torch.zeros_like(FULL), mesh((0, 1)), (Replicate(), Shard(0)))},
        "optim": {},
    }
    with pytest.raises(CheckpointFormatError, match=r"state_dict\['optim'\]\[0\]: shard mismatch"):
        heal(sent, ref)


# ----------------------------------------------------------------------------- hostile headers


def _dt_header(edit) -> Tuple[bytes, List[torch.Tensor]]:
    tree, specs, tensors = ser.flatten({"w": _sender((Replicate(), Shard(0)))})
    doc = json.loads(ser.encode_header(tree, specs))
    edit(doc["tree"][1][0][1])
    return json.dumps(doc).encode(), tensors


def _meta(key: str, value: Any):
    def edit(node: List[Any]) -> None:
        node[2][key] = value

    return edit


def _mesh(key: str, value: Any):
    def edit(node: List[Any]) -> None:
        node[2]["mesh"][key] = value

    return edit


HOSTILE = {
    "unknown placement": _meta("placements", [["R"], ["X", 0]]),
    "shard dim out of range": _meta("placements", [["R"], ["S", 2]]),
    "too few placements": _meta("placements", [["S", 0]]),
    "partial op": _meta("placements", [["R"], ["P", "os.system"]]),
    "coordinate out of range": _mesh("coord", [0, 2]),
    "negative coordinate": _mesh("coord", [0, -1]),
    "zero mesh dim": _mesh("shape", [0, 2]),
    "duplicate names": _mesh("names", ["a", "a"]),
    "device": _mesh("device", "cpu; rm"),
    "extra key": _meta("pickle", "x"),
    "stride length": _meta("stride", [1]),
    "ndim of local": _meta("shape", [5, 6, 1]),
    "flags": _meta("param", 1),
    "tensor index": lambda node: node.__setitem__(1, 99),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_dtensor_metadata_is_rejected(case: str) -> None:
    header, tensors = _dt_header(HOSTILE[case])
    _, tree, _ = ser.decode_header(header)
    with pytest.raises(CheckpointFormatError, match="invalid checkpoint metadata"):
        ser.unflatten(tree, tensors)


def test_a_local_tensor_of_the_wrong_size_is_refused_at_restore() -> None:
    # Structurally fine, but the piece does not fit the coordinate it claims.
    sent = dtensor(FULL, mesh((0, 1)), (Replicate(), Shard(0)), local=torch.zeros(3, 6))
    ref = dtensor(torch.zeros_like(FULL), mesh((0, 1)), (Replicate(), Shard(0)))
    with pytest.raises(
        CheckpointFormatError,
        match=r"\['w'\]: the source's local tensor has "
        r"shape \[3, 6\]; its piece .* has \[2, 6\]",
    ):
        heal({"w": sent}, {"w": ref})


# ----------------------------------------------------------------------------- sender side


def test_unsupported_placement_is_refused_at_the_sender_naming_the_key() -> None:
    class Custom(Partial):
        pass

    d = DTensor.from_local(
        torch.ones(2, 2),
        mesh((0,), (1,), ("x",)),
        [Custom()],
        run_check=False,
        shape=torch.Size([2, 2]),
        stride=(2, 1),
    )
    with pytest.raises(TypeError, match=r"state_dict\['a'\]\['d'\]: DTensor placement"):
        ser.flatten({"a": {"d": d}})


def test_other_tensor_subclasses_are_still_refused() -> None:
    class Sub(torch.Tensor):
        pass

    with pytest.raises(TypeError, match=r"\['s'\]: tensor subclass Sub"):
        ser.flatten({"s": torch.ones(2).as_subclass(Sub)})


def test_plain_state_dicts_encode_as_before() -> None:
    # No DTensor: the header is exactly what it was (no new fields, same node tags).
    state: Dict[str, Any] = {"w": torch.ones(2), "n": 3}
    tree, specs, _ = ser.flatten(state)
    assert "DT" not in json.dumps(tree)
    assert transfer(state)["n"] == 3
