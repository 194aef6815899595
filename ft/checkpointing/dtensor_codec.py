"""DTensor leaves of the checkpoint format (serialization.py): a DTensor travels as its local
tensor (an ordinary tensor of the checkpoint: checksummed and fetched in ranges like any
other) plus a JSON description of where that piece sits, and becomes a DTensor again on the
receiver only on the receiver's own mesh, after checks (docs/design.md, "HSDP").

The node: ``["DT", i, meta]``, tensor ``i`` being the local tensor, and ``meta``::

    {"mesh": {"device": "cpu", "shape": [2, 2], "names": ["dp_replicate", "dp_shard"],
              "coord": [0, 1]},                  # the sender's coordinate on each dimension
     "placements": [["R"], ["S", 0]],            # per mesh dimension
     "shape": [16, 8], "stride": [8, 1],         # the global tensor's
     "param": false, "grad": false}              # nn.Parameter, and its requires_grad

Placements: ``["R"]`` Replicate, ``["S", dim]`` Shard, ``["SS", dim, split_factor]``
_StridedShard (FSDP2 with tensor parallelism), ``["P", reduce_op]`` Partial. No other
placement is sent (the sender raises TypeError naming the key).

Two steps on the receiver:

* :func:`parse` (from ``serialization.unflatten``) checks the description's structure and
  returns a :class:`ReceivedDTensor`: the local tensor and its description, not yet a
  DTensor (a mesh is a live object of the receiving process, never something a peer sends).
* :func:`restore_dtensors` (from the Manager, after a heal arrives) turns each one into a
  DTensor on the receiver's mesh: the mesh of its own DTensor at the same key, or, where it
  has none there (an optimizer's state before its first step), a mesh of its own state with
  the same device type, shape and dimension names. It checks that the placements, the global
  shape and the mesh match (a Replicate dimension's size aside: it does not change the piece),
  and that on every dimension that is not Replicate the sender's coordinate is the receiver's
  (the same shard), and raises :class:`CheckpointFormatError` naming the key otherwise.
  Nothing is ever redistributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ft.checkpointing.errors import CheckpointFormatError

__all__ = ["ReceivedDTensor", "encode", "parse", "restore_dtensors", "describe_placements"]

MAX_MESH_DIMS = 16
_PARTIAL_OPS = ("sum", "avg", "min", "max", "product", "band", "bor", "bxor")
_META_KEYS = {"mesh", "placements", "shape", "stride", "param", "grad"}
_MESH_KEYS = {"device", "shape", "names", "coord"}


def _path_str(path: Sequence[Any]) -> str:
    return "state_dict" + "".join(f"[{k!r}]" for k in path)


# ----------------------------------------------------------------------------- placements


def _placement_json(p: Any, path: Sequence[Any]) -> List[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    # exact types: a subclass (_MaskPartial, ...) carries state this encoding would drop
    t = type(p)
    if t is Replicate:
        return ["R"]
    if t is Shard:
        return ["S", int(p.dim)]
    if t is _StridedShard:
        return ["SS", int(p.dim), int(p.split_factor)]
    if t is Partial:
        return ["P", str(p.reduce_op)]
    raise TypeError(
        f"{_path_str(path)}: DTensor placement {p!r} ({t.__name__}) cannot be sent "
        f"by the checkpoint transport (Replicate, Shard, _StridedShard and Partial "
        f"can)"
    )


def _placement_obj(j: List[Any]) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if j[0] == "R":
        return Replicate()
    if j[0] == "S":
        return Shard(j[1])
    if j[0] == "SS":
        return _StridedShard(j[1], split_factor=j[2])
    return Partial(j[1])


def describe_placements(placements: Sequence[List[Any]]) -> str:
    """``(Replicate(), Shard(0))`` from the JSON form, for error messages."""
    names = {
        "R": "Replicate()",
        "S": "Shard({})",
        "SS": "_StridedShard({}, sf={})",
        "P": "Partial({!r})",
    }
    return "(" + ", ".join(names[p[0]].format(*p[1:]) for p in placements) + ")"


def _placements_json(dt: Any, path: Sequence[Any]) -> List[List[Any]]:
    return [_placement_json(p, path) for p in dt.placements]


# ----------------------------------------------------------------------------- sender side


def encode(dt: Any, path: Sequence[Any]) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """(local tensor, description) of DTensor ``dt``. Raises TypeError naming ``path`` for a
    placement that cannot be sent, or a rank that holds no piece of ``dt``."""
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise TypeError(
            f"{_path_str(path)}: this rank is not part of the DTensor's mesh "
            f"{mesh}; it holds no piece of it to send"
        )
    names = mesh.mesh_dim_names
    meta = {
        "mesh": {
            "device": str(mesh.device_type),
            "shape": [int(n) for n in mesh.shape],
            "names": None if names is None else [str(n) for n in names],
            "coord": [int(c) for c in coord],
        },
        "placements": _placements_json(dt, path),
        "shape": [int(n) for n in dt.shape],
        "stride": [int(s) for s in dt.stride()],
        "param": isinstance(dt, torch.nn.Parameter),
        "grad": bool(dt.requires_grad) and isinstance(dt, torch.nn.Parameter),
    }
    with torch.no_grad():  # the local tensor itself (to_local under grad makes a view)
        local = dt.to_local()
    return local, meta


# ----------------------------------------------------------------------------- receiver side


@dataclass(frozen=True)
class MeshInfo:
    """A mesh as a peer described it.

    Contract: plain data, checked by :func:`parse` (every size >= 1, names unique, the
    coordinate inside the shape); :meth:`same_layout` is true for a live mesh of this process
    with the same device type, dimension names and number of dimensions, and the same size on
    every dimension a piece depends on (coordinates are not compared).
    """

    device: str
    shape: Tuple[int, ...]
    names: Optional[Tuple[str, ...]]
    coord: Tuple[int, ...]

    def describe(self) -> str:
        dims = (
            zip(self.names, self.shape)
            if self.names is not None
            else ((f"dim_{i}", n) for i, n in enumerate(self.shape))
        )
        return f"{self.device} mesh ({', '.join(f'{k}={n}' for k, n in dims)})"

    def same_layout(self, mesh: Any, placements: Sequence[Tuple[Any, ...]]) -> bool:
        names = mesh.mesh_dim_names
        sizes = tuple(int(n) for n in mesh.shape)
        # A Replicate dimension's size does not change the piece a rank holds (ft's replicate
        # dimension has a nominal size, which groups may give differently): not compared.
        return (
            str(mesh.device_type) == self.device
            and (None if names is None else tuple(names)) == self.names
            and len(sizes) == len(self.shape)
            and all(p[0] == "R" or a == b for p, a, b in zip(placements, sizes, self.shape))
        )


@dataclass(frozen=True)
class ReceivedDTensor:
    """A DTensor as received: its local tensor and where that piece sits, not yet bound to a
    mesh of this process.

    Contract: made only by :func:`parse`, so its description is well formed (not yet checked
    against any mesh); it is not a tensor, and nothing loads it as one. The Manager turns it
    into a DTensor (:func:`restore_dtensors`); code that receives a checkpoint by other means
    calls that itself.
    """

    local: torch.Tensor
    mesh: MeshInfo
    placements: Tuple[Tuple[Any, ...], ...]
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    param: bool
    requires_grad: bool


def _fail(msg: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"invalid checkpoint metadata from peer: {msg}")


def _ints(v: Any, lo: int, max_len: int) -> bool:
    return type(v) is list and len(v) <= max_len and all(type(x) is int and x >= lo for x in v)


def _parse_placement(p: Any, ndim: int) -> Tuple[Any, ...]:
    if type(p) is list and p:
        tag = p[0]
        if tag == "R" and len(p) == 1:
            return ("R",)
        if tag == "S" and len(p) == 2 and type(p[1]) is int and 0 <= p[1] < ndim:
            return ("S", p[1])
        if (
            tag == "SS"
            and len(p) == 3
            and type(p[1]) is int
            and 0 <= p[1] < ndim
            and type(p[2]) is int
            and p[2] >= 1
        ):
            return ("SS", p[1], p[2])
        if tag == "P" and len(p) == 2 and p[1] in _PARTIAL_OPS:
            return ("P", p[1])
    raise _fail(f"bad DTensor placement {p!r:.60}")


def parse(meta: Any, local: torch.Tensor) -> ReceivedDTensor:
    """Checks a DTensor description's structure (not yet against any mesh)."""
    if type(meta) is not dict or set(meta) != _META_KEYS:
        raise _fail("bad DTensor description")
    mesh = meta["mesh"]
    if type(mesh) is not dict or set(mesh) != _MESH_KEYS:
        raise _fail("bad DTensor mesh description")
    device, shape, names, coord = mesh["device"], mesh["shape"], mesh["names"], mesh["coord"]
    if type(device) is not str or not device or len(device) > 64 or not device.isidentifier():
        raise _fail(f"bad mesh device {device!r:.60}")
    if not _ints(shape, 1, MAX_MESH_DIMS) or not shape:
        raise _fail(f"bad mesh shape {shape!r:.60}")
    if names is not None and (
        type(names) is not list
        or len(names) != len(shape)
        or not all(type(n) is str and len(n) <= 256 for n in names)
        or len(set(names)) != len(names)
    ):
        raise _fail(f"bad mesh dimension names {names!r:.100}")
    if (
        not _ints(coord, 0, MAX_MESH_DIMS)
        or len(coord) != len(shape)
        or any(c >= n for c, n in zip(coord, shape))
    ):
        raise _fail(f"bad mesh coordinate {coord!r:.60} for mesh shape {shape}")
    gshape, gstride = meta["shape"], meta["stride"]
    if not _ints(gshape, 0, 64) or not _ints(gstride, 0, 64) or len(gstride) != len(gshape):
        raise _fail(f"bad DTensor shape {gshape!r:.60} / stride {gstride!r:.60}")
    placements = meta["placements"]
    if type(placements) is not list or len(placements) != len(shape):
        raise _fail(f"DTensor placements {placements!r:.60} do not match mesh shape {shape}")
    parsed = tuple(_parse_placement(p, len(gshape)) for p in placements)
    if type(meta["param"]) is not bool or type(meta["grad"]) is not bool:
        raise _fail("bad DTensor flags")
    if local.dim() != len(gshape):
        raise _fail(f"DTensor local tensor has {local.dim()} dims, its global shape {gshape}")
    return ReceivedDTensor(
        local=local,
        mesh=MeshInfo(device, tuple(shape), None if names is None else tuple(names), tuple(coord)),
        placements=parsed,
        shape=tuple(gshape),
        stride=tuple(gstride),
        param=meta["param"],
        requires_grad=meta["grad"],
    )


# ----------------------------------------------------------------------------- restoring


def _dtensor_type() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


def _contains_received(o: Any) -> bool:
    if isinstance(o, ReceivedDTensor):
        return True
    if isinstance(o, dict):
        return any(_contains_received(v) for v in o.values())
    if isinstance(o, (list, tuple)):
        return any(_contains_received(v) for v in o)
    return False


_MISSING = object()


def _child(ref: Any, key: Any) -> Any:
    if isinstance(ref, dict):
        return ref.get(key, _MISSING)
    if isinstance(ref, (list, tuple)) and type(key) is int and 0 <= key < len(ref):
        return ref[key]
    return _MISSING


class _Restorer:
    """Walks a received tree beside the receiver's own state (see :func:`restore_dtensors`).

    Contract: containers are changed in place (tuples rebuilt); a ReceivedDTensor reached by
    several keys becomes one DTensor; the first mismatch raises CheckpointFormatError naming
    its key, and then nothing of the tree is to be loaded.
    """

    def __init__(self, reference: Any) -> None:
        self.DTensor = _dtensor_type()
        self.meshes: List[Any] = []
        self._collect_meshes(reference)
        self._done: Dict[int, Any] = {}  # id(ReceivedDTensor) -> its DTensor (shared leaves)

    def _collect_meshes(self, o: Any) -> None:
        if isinstance(o, self.DTensor):
            if all(m is not o.device_mesh for m in self.meshes):
                self.meshes.append(o.device_mesh)
        elif isinstance(o, dict):
            for v in o.values():
                self._collect_meshes(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                self._collect_meshes(v)

    def walk(self, o: Any, ref: Any, path: List[Any]) -> Any:
        if isinstance(o, ReceivedDTensor):
            key = id(o)
            if key not in self._done:
                self._done[key] = self.restore(o, ref, path)
            return self._done[key]
        if isinstance(o, dict):
            for k in list(o):
                o[k] = self.walk(o[k], _child(ref, k), path + [k])
            return o
        if isinstance(o, list):
            for i, v in enumerate(o):
                o[i] = self.walk(v, _child(ref, i), path + [i])
            return o
        if isinstance(o, tuple):
            return tuple(self.walk(v, _child(ref, i), path + [i]) for i, v in enumerate(o))
        return o

    def restore(self, r: ReceivedDTensor, ref: Any, path: List[Any]) -> Any:
        where = _path_str(path)
        sent = describe_placements(r.placements)
        if ref is not _MISSING and not isinstance(ref, self.DTensor):
            raise CheckpointFormatError(
                f"{where}: the source sent a DTensor {sent} on a {r.mesh.describe()}, where "
                f"this replica has {type(ref).__name__}; refusing to load it"
            )
        if ref is not _MISSING:
            mesh = ref.device_mesh
            mine = [list(p) for p in _placements_json(ref, path)]
            if mine != [list(p) for p in r.placements]:
                raise CheckpointFormatError(
                    f"{where}: placement mismatch: the source sent {sent}, this replica holds "
                    f"{describe_placements(mine)}; refusing to load it (nothing is "
                    f"redistributed)"
                )
            if tuple(ref.shape) != r.shape:
                raise CheckpointFormatError(
                    f"{where}: the source's DTensor has global shape {list(r.shape)}, this "
                    f"replica's {list(ref.shape)}"
                )
            if not r.mesh.same_layout(mesh, r.placements):
                raise CheckpointFormatError(
                    f"{where}: the source's DTensor is on a {r.mesh.describe()}, this "
                    f"replica's on {mesh}"
                )
        else:
            found = [m for m in self.meshes if r.mesh.same_layout(m, r.placements)]
            if not found:
                raise CheckpointFormatError(
                    f"{where}: the source sent a DTensor {sent} on a {r.mesh.describe()}, and "
                    f"no DTensor of this replica's state is on such a mesh (nor at this key)"
                )
            mesh = found[0]
        self._check_coordinate(r, mesh, where)
        placements = [_placement_obj(list(p)) for p in r.placements]
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, _ = compute_local_shape_and_global_offset(r.shape, mesh, placements)
        if tuple(r.local.shape) != tuple(local_shape):
            raise CheckpointFormatError(
                f"{where}: the source's local tensor has shape {list(r.local.shape)}; its "
                f"piece of a {list(r.shape)} tensor at that coordinate has "
                f"{list(local_shape)}"
            )
        out = self.DTensor.from_local(
            r.local, mesh, placements, run_check=False, shape=torch.Size(r.shape), stride=r.stride
        )
        if r.param:
            out = torch.nn.Parameter(out, requires_grad=r.requires_grad)
        return out

    @staticmethod
    def _check_coordinate(r: ReceivedDTensor, mesh: Any, where: str) -> None:
        mine = mesh.get_coordinate()
        if mine is None:
            raise CheckpointFormatError(f"{where}: this rank is not part of {mesh}")
        names = mesh.mesh_dim_names or tuple(f"dim_{i}" for i in range(mesh.ndim))
        for dim, p in enumerate(r.placements):
            # On a Replicate dimension every member holds the same piece; elsewhere the
            # coordinate says which piece (a shard, or one rank's partial values).
            if p[0] != "R" and r.mesh.coord[dim] != mine[dim]:
                raise CheckpointFormatError(
                    f"{where}: shard mismatch on mesh dimension {names[dim]!r} "
                    f"({describe_placements([list(p)])[1:-1]}): the source holds the piece of "
                    f"coordinate {r.mesh.coord[dim]}, this rank the piece of coordinate "
                    f"{mine[dim]}; refusing to load it (nothing is redistributed)"
                )


def restore_dtensors(state: Any, reference: Callable[[], Any]) -> Any:
    """``state`` (a received tree, changed in place where it can be) with every
    :class:`ReceivedDTensor` made a DTensor on this process's mesh, checked against
    ``reference()``, this process's own state with the same structure (called only when
    ``state`` holds a DTensor). Raises CheckpointFormatError naming the key of the first
    mismatch (see the module docstring)."""
    if not _contains_received(state):
        return state
    ref = reference()
    return _Restorer(ref).walk(state, ref, [])
