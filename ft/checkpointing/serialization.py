"""Safe encoding of state dicts for the checkpoint transports.

Nothing received from a peer is ever unpickled. A state dict is split into

* a *tree*: a JSON document describing the containers (dict, OrderedDict, list, tuple) and the
  plain leaves (int, float incl. inf/nan/-0.0, bool, None, str, bytes, torch.dtype,
  torch.device, torch.Size), with tensors replaced by an index; and
* a list of *tensor specs* (dtype, shape, strides, byte count, Parameter flag) plus the raw
  tensor bytes, which the transports move and checksum.

Node encoding (compact JSON arrays, first element is the tag)::

    ["T", i]            tensor number i          ["i", 3]         int (any size)
    ["f", "0x1.8p+1"]   float (float.hex, exact) ["b", true]      bool
    ["n"]               None                     ["s", "text"]    str
    ["y", "base64"]     bytes                    ["dt", "float32"] torch.dtype
    ["dv", "cuda:0"]    torch.device             ["sz", [2, 3]]   torch.Size
    ["l", [nodes]]      list                     ["t", [nodes]]   tuple
    ["d", [[k, v]..]]   dict                     ["od", [[k, v]..], meta|null] OrderedDict
                                                 (meta: its ``_metadata`` attribute, as
                                                 nn.Module.state_dict sets it)

Dict keys are nodes too (so ``int`` keys of optimizer state survive exactly); they must be
hashable scalars (int, float, bool, None, str, bytes) or tuples of them.

A DTensor is ``["DT", i, meta]``: tensor ``i`` is its local tensor (sent, checksummed and fetched
in ranges like any other) and ``meta`` says where that piece sits (mesh shape and dimension
names, the sender's coordinate, the placements, the global shape). ``unflatten`` gives it back as
a :class:`ft.checkpointing.dtensor_codec.ReceivedDTensor`, which becomes a DTensor only on the
receiver's own mesh, after the checks of ``dtensor_codec.restore_dtensors`` (the Manager runs
them when a heal arrives). No other tensor subclass is sent.

The receiver validates everything (tags, types, dtypes against a whitelist, shapes, byte counts,
strides, tensor indices, nesting depth) and raises :class:`CheckpointFormatError` otherwise.
"""

from __future__ import annotations

import base64
import json
import math
import mmap
import sys
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ft import _C  # ft's compiled extension (torch's _C naming)

from ft.checkpointing.errors import CheckpointFormatError

__all__ = [
    "FORMAT",
    "MAX_HEADER_BYTES",
    "check_header_size",
    "TensorSpec",
    "flatten",
    "unflatten",
    "encode_header",
    "decode_header",
    "allocate",
    "finalize",
    "byte_view",
    "crc32",
    "crc32c",
    "torch_checksum",
]

# v2: tensor bytes are checksummed with CRC-32C (v1: zlib CRC-32). Headers say which format, so
# peers of different versions fail with "unknown format", not with a checksum mismatch.
FORMAT = "ft-ckpt-v2"
MAX_DEPTH = 256
# Largest header a receiver reads and a source stages. A tensor's spec and its place in the tree
# take ~130-250 bytes of JSON, so this holds ~250k tensors: a 70B dense model with Adam state
# (~3k tensors) needs ~1 MB, an unfused MoE with 100k+ expert tensors some 25 MB. The bound is
# what keeps a hostile or broken source from making a receiver read and parse without end
# (JSON parses at ~20-150 MB/s on one core: a full header is ~0.5-3 s of a heal's deadline).
MAX_HEADER_BYTES = 64 << 20


def check_header_size(header: bytes, num_tensors: int) -> None:
    """Refuses, at the source, a header no receiver would accept (clearer than every receiver
    refusing it)."""
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(
            f"the checkpoint's metadata takes {len(header)} bytes ({num_tensors} tensors); "
            f"receivers accept at most {MAX_HEADER_BYTES}: keep fewer tensors or smaller "
            f"non-tensor values in the state dict"
        )


_QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
_DTYPES: Dict[str, torch.dtype] = {}
for _v in vars(torch).values():
    if isinstance(_v, torch.dtype):
        _name = str(_v).split(".")[-1]
        if _name not in _QUANTIZED:
            _DTYPES[_name] = _v


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def _path_str(path: Sequence[Any]) -> str:
    return "state_dict" + "".join(f"[{k!r}]" for k in path)


# ----------------------------------------------------------------------------- sender side


@dataclass
class TensorSpec:
    dtype: torch.dtype
    shape: Tuple[int, ...]
    stride: Optional[Tuple[int, ...]]  # only set for dense non-contiguous tensors
    nbytes: int
    param: bool = False
    requires_grad: bool = False
    copied: bool = False  # sender side only: the sent tensor is a copy, not the original

    def to_json(self) -> Dict[str, Any]:
        return {
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "stride": None if self.stride is None else list(self.stride),
            "nbytes": self.nbytes,
            "param": self.param,
            "grad": self.requires_grad,
        }

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _dense_stride_ok(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """True if (shape, stride) is non-overlapping and dense (a permutation of contiguous)."""
    if len(shape) != len(stride):
        return False
    dims = sorted((s, n) for n, s in zip(shape, stride) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return False
        expected *= n
    return all(s >= 0 for s in stride)


def _is_dtensor(t: Any) -> bool:
    # No DTensor exists unless torch.distributed.tensor was imported: check without importing.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


class _Flattener:
    def __init__(self) -> None:
        self.tensors: List[torch.Tensor] = []
        self.specs: List[TensorSpec] = []
        self._index: Dict[int, int] = {}
        self._dtensors: Dict[int, List[Any]] = {}  # id(DTensor) -> its node (sent once)
        self._keep: List[Any] = []  # keeps the objects whose id() is a key above alive

    def dtensor(self, t: torch.Tensor, path: List[Any]) -> List[Any]:
        key = id(t)
        if key not in self._dtensors:
            from ft.checkpointing import dtensor_codec

            local, meta = dtensor_codec.encode(t, path)
            self._keep.append(local)
            self._dtensors[key] = ["DT", self.tensor(local, path)[1], meta]
        return self._dtensors[key]

    def tensor(self, t: torch.Tensor, path: List[Any]) -> List[Any]:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            if _is_dtensor(t):
                return self.dtensor(t, path)
            raise TypeError(
                f"{_path_str(path)}: tensor subclass {type(t).__name__} is not supported by "
                "the checkpoint transport (DTensor is; convert others to a plain tensor)"
            )
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise TypeError(
                f"{_path_str(path)}: only dense (strided, non-quantized) tensors with data can "
                f"be sent, got layout={t.layout} quantized={t.is_quantized} device={t.device}"
            )
        key = id(t)
        if key in self._index:  # the same tensor object twice (tied weights): send once
            return ["T", self._index[key]]
        data = t.detach()
        if data.is_conj():
            data = data.resolve_conj()
        if data.is_neg():
            data = data.resolve_neg()
        stride: Optional[Tuple[int, ...]] = None
        copied = bool(t.is_conj() or t.is_neg())
        if not data.is_contiguous():
            copied = True
            if data.numel() > 0 and _dense_stride_ok(data.shape, data.stride()):
                stride = tuple(data.stride())
            data = data.contiguous()
        spec = TensorSpec(
            dtype=t.dtype,
            shape=tuple(t.shape),
            stride=stride,
            nbytes=t.numel() * t.element_size(),
            param=isinstance(t, torch.nn.Parameter),
            requires_grad=bool(t.requires_grad) and isinstance(t, torch.nn.Parameter),
            copied=copied,
        )
        self._index[key] = len(self.tensors)
        self.tensors.append(data)
        self.specs.append(spec)
        return ["T", self._index[key]]

    def key(self, k: Any, path: List[Any]) -> List[Any]:
        if isinstance(k, tuple):
            return ["t", [self.key(x, path) for x in k]]
        if k is None or isinstance(k, (bool, int, float, str, bytes)):
            return self.node(k, path)
        raise TypeError(
            f"{_path_str(path)}: dict key {k!r} of type {type(k).__name__} is not supported "
            "(use str, int, float, bool, None, bytes or tuples of them)"
        )

    def node(self, obj: Any, path: List[Any]) -> List[Any]:
        if len(path) > MAX_DEPTH:
            raise TypeError(f"{_path_str(path[:8])}...: nesting deeper than {MAX_DEPTH}")
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        # exact types first: bool is an int subclass, and subclasses (IntEnum, numpy scalars,
        # namedtuples, defaultdicts...) would not round-trip as themselves
        t = type(obj)
        if obj is None:
            return ["n"]
        if t is bool:
            return ["b", obj]
        if t is int:
            return ["i", obj]
        if t is float:
            return ["f", obj.hex()]
        if t is str:
            return ["s", obj]
        if t in (bytes, bytearray):
            return ["y", base64.b64encode(bytes(obj)).decode("ascii")]
        if t is torch.dtype:
            return ["dt", dtype_name(obj)]
        if t is torch.device:
            return ["dv", str(obj)]
        if t is torch.Size:
            return ["sz", [int(x) for x in obj]]
        if t is list:
            return ["l", [self.node(v, path + [i]) for i, v in enumerate(obj)]]
        if t is tuple:
            return ["t", [self.node(v, path + [i]) for i, v in enumerate(obj)]]
        if t is dict or t is OrderedDict:
            items = [[self.key(k, path + [k]), self.node(v, path + [k])] for k, v in obj.items()]
            if t is dict:
                return ["d", items]
            meta = getattr(obj, "_metadata", None)
            meta_node = None if meta is None else self.node(meta, path + ["_metadata"])
            return ["od", items, meta_node]
        raise TypeError(
            f"{_path_str(path)}: values of type {t.__module__}.{t.__qualname__} cannot be sent "
            "by the checkpoint transport (supported: tensors, dict, OrderedDict, list, tuple, "
            "int, float, bool, None, str, bytes, torch.dtype, torch.device, torch.Size)"
        )


def flatten(state_dict: Any) -> Tuple[Any, List[TensorSpec], List[torch.Tensor]]:
    """Splits ``state_dict`` into (tree, tensor specs, tensors).

    The tensors are detached and contiguous; contiguous inputs are returned as they are (no
    copy), so a caller that keeps them must not mutate the originals meanwhile.

    Raises:
        TypeError: a value that cannot be encoded safely, naming its key path.
    """
    f = _Flattener()
    tree = f.node(state_dict, [])
    return tree, f.specs, f.tensors


def encode_header(tree: Any, specs: Sequence[TensorSpec], **extra: Any) -> bytes:
    doc = {"format": FORMAT, "tree": tree, "tensors": [s.to_json() for s in specs]}
    doc.update(extra)
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


# ----------------------------------------------------------------------------- receiver side


def _fail(msg: str) -> "CheckpointFormatError":
    return CheckpointFormatError(f"invalid checkpoint metadata from peer: {msg}")


def _is_int(x: Any) -> bool:
    return type(x) is int


def _parse_spec(d: Any, i: int) -> TensorSpec:
    if type(d) is not dict:
        raise _fail(f"tensor {i}: spec is not an object")
    name = d.get("dtype")
    if type(name) is not str or name not in _DTYPES:
        raise _fail(f"tensor {i}: unknown dtype {name!r}")
    dtype = _DTYPES[name]
    shape = d.get("shape")
    if type(shape) is not list or len(shape) > 64 or not all(_is_int(n) and n >= 0 for n in shape):
        raise _fail(f"tensor {i}: bad shape {shape!r}")
    nbytes = d.get("nbytes")
    if not _is_int(nbytes) or nbytes != math.prod(shape) * dtype.itemsize:
        raise _fail(f"tensor {i}: nbytes {nbytes!r} does not match shape {shape} and {name}")
    stride = d.get("stride")
    if stride is not None:
        if (
            type(stride) is not list
            or not all(_is_int(s) for s in stride)
            or not _dense_stride_ok(shape, stride)
        ):
            raise _fail(f"tensor {i}: bad stride {stride!r} for shape {shape}")
        stride = tuple(stride)
    param = d.get("param", False)
    grad = d.get("grad", False)
    if type(param) is not bool or type(grad) is not bool:
        raise _fail(f"tensor {i}: bad flags")
    return TensorSpec(dtype, tuple(shape), stride, nbytes, param, grad)


def decode_header(data: bytes) -> Tuple[Dict[str, Any], Any, List[TensorSpec]]:
    """Parses and validates a header; returns (document, tree, specs)."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise _fail(f"not valid JSON ({type(e).__name__}: {e})") from None
    if type(doc) is not dict or doc.get("format") != FORMAT:
        raise _fail(f"unknown format {doc.get('format') if type(doc) is dict else doc!r:.80}")
    raw_specs = doc.get("tensors")
    if type(raw_specs) is not list:
        raise _fail("'tensors' is not a list")
    specs = [_parse_spec(d, i) for i, d in enumerate(raw_specs)]
    return doc, doc.get("tree"), specs


def _scalar(node: List[Any]) -> Any:
    """Decodes a scalar node; returns _NOT_SCALAR for container or tensor nodes."""
    tag = node[0]
    n = len(node)
    if tag == "n" and n == 1:
        return None
    if n != 2:
        return _NOT_SCALAR
    v = node[1]
    if tag == "i" and _is_int(v):
        return v
    if tag == "b" and type(v) is bool:
        return v
    if tag == "s" and type(v) is str:
        return v
    if tag == "f" and type(v) is str:
        try:
            return float.fromhex(v)
        except (ValueError, OverflowError):
            raise _fail(f"bad float {v!r:.40}") from None
    if tag == "y" and type(v) is str:
        try:
            return base64.b64decode(v.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError):
            raise _fail("bad base64 bytes") from None
    if tag == "dt" and type(v) is str:
        if v not in _DTYPES:
            raise _fail(f"unknown dtype {v!r:.40}")
        return _DTYPES[v]
    if tag == "dv" and type(v) is str:
        try:
            return torch.device(v)
        except (RuntimeError, ValueError):
            raise _fail(f"bad device {v!r:.40}") from None
    if tag == "sz" and type(v) is list and all(_is_int(x) and x >= 0 for x in v):
        return torch.Size(v)
    return _NOT_SCALAR


_NOT_SCALAR = object()


class _Unflattener:
    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = tensors
        self._dtensors: Dict[int, Tuple[Any, Any]] = {}  # tensor index -> (meta, leaf)

    def dtensor(self, node: List[Any]) -> Any:
        if len(node) != 3 or not _is_int(node[1]) or not 0 <= node[1] < len(self.tensors):
            raise _fail(f"bad DTensor node {node!r:.60}")
        i, meta = node[1], node[2]
        if i in self._dtensors:  # one DTensor reached by several keys: one object, as sent
            if self._dtensors[i][0] != meta:
                raise _fail(f"tensor {i} is the local tensor of two different DTensors")
            return self._dtensors[i][1]
        from ft.checkpointing import dtensor_codec

        leaf = dtensor_codec.parse(meta, self.tensors[i])
        self._dtensors[i] = (meta, leaf)
        return leaf

    def key(self, node: Any, depth: int) -> Any:
        if type(node) is not list or not node or type(node[0]) is not str:
            raise _fail("bad dict key node")
        if node[0] == "t" and len(node) == 2 and type(node[1]) is list:
            if depth > MAX_DEPTH:
                raise _fail("nesting too deep")
            return tuple(self.key(x, depth + 1) for x in node[1])
        v = _scalar(node)
        if v is _NOT_SCALAR or isinstance(v, (torch.dtype, torch.device, torch.Size)):
            raise _fail(f"unsupported dict key node {node[0]!r:.20}")
        return v

    def items(self, raw: Any, depth: int) -> List[Tuple[Any, Any]]:
        if type(raw) is not list:
            raise _fail("dict items are not a list")
        out = []
        for kv in raw:
            if type(kv) is not list or len(kv) != 2:
                raise _fail("bad dict item")
            out.append((self.key(kv[0], depth + 1), self.node(kv[1], depth + 1)))
        return out

    def node(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _fail("nesting too deep")
        if type(node) is not list or not node or type(node[0]) is not str:
            raise _fail(f"bad node {node!r:.60}")
        tag = node[0]
        if tag == "DT":
            return self.dtensor(node)
        if tag == "T":
            if len(node) != 2 or not _is_int(node[1]) or not 0 <= node[1] < len(self.tensors):
                raise _fail(f"bad tensor reference {node!r:.60}")
            return self.tensors[node[1]]
        if tag in ("l", "t"):
            if len(node) != 2 or type(node[1]) is not list:
                raise _fail(f"bad {tag} node")
            vals = [self.node(v, depth + 1) for v in node[1]]
            return vals if tag == "l" else tuple(vals)
        if tag == "d":
            if len(node) != 2:
                raise _fail("bad dict node")
            return dict(self.items(node[1], depth))
        if tag == "od":
            if len(node) != 3:
                raise _fail("bad OrderedDict node")
            od: OrderedDict = OrderedDict(self.items(node[1], depth))
            if node[2] is not None:
                od._metadata = self.node(node[2], depth + 1)  # type: ignore[attr-defined]
            return od
        v = _scalar(node)
        if v is _NOT_SCALAR:
            raise _fail(f"unknown node {tag!r:.20}")
        return v


def unflatten(tree: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """Rebuilds the state dict from a validated tree and the received tensors."""
    try:
        return _Unflattener(tensors).node(tree, 0)
    except RecursionError:
        raise _fail("nesting too deep") from None


# Received tensors at least this large get memory of their own, advised for transparent huge
# pages. Why: a receiver writes every byte of fresh memory, and the kernel faults it in 4 KiB
# at a time: on the development VM faulting 16 MiB costs ~11 ms, five times the copy itself;
# with 2 MiB pages it costs ~1 ms. One mapping per tensor (not one arena for the whole state)
# so that each tensor's memory goes back to the OS as soon as that tensor dies.
HUGE_PAGE_BYTES = 2 << 20


def _allocate_huge_pages(spec: TensorSpec) -> Optional[torch.Tensor]:
    try:
        buf = mmap.mmap(-1, spec.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, AttributeError, OverflowError):
        return None
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass  # no THP here: still a correct (if slower to fault) buffer
    try:
        # frombuffer keeps a reference to the mapping; it is unmapped when the tensor dies
        flat = torch.frombuffer(buf, dtype=spec.dtype, count=spec.numel)
    except (TypeError, ValueError, RuntimeError):
        buf.close()
        return None
    return flat.view(spec.shape)


def allocate(spec: TensorSpec, device: torch.device) -> torch.Tensor:
    """A contiguous tensor to receive ``spec``'s bytes into."""
    if device.type == "cpu" and spec.nbytes >= HUGE_PAGE_BYTES:
        t = _allocate_huge_pages(spec)
        if t is not None:
            return t
    try:
        return torch.empty(spec.shape, dtype=spec.dtype, device=device)
    except (RuntimeError, ValueError, TypeError, OverflowError, MemoryError) as e:
        raise _fail(f"cannot allocate {spec}: {e}") from None


def finalize(t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """Restores the sender's strides and Parameter-ness on a received contiguous tensor."""
    if spec.stride is not None and tuple(t.stride()) != spec.stride:
        out = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=t.device)
        out.copy_(t)
        t = out
    if spec.param:
        t = torch.nn.Parameter(t, requires_grad=spec.requires_grad)
    return t


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor (a view, no copy)."""
    assert t.is_contiguous()
    return t.reshape(-1).view(torch.uint8)


def memview(t: torch.Tensor) -> memoryview:
    """A (writable) memoryview of a contiguous CPU tensor's bytes, without copying."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(byte_view(t).numpy()).cast("B")


def crc32(data: Any, value: int = 0) -> int:
    """zlib CRC-32: for headers and control words (small)."""
    return zlib.crc32(data, value)


def crc32c(data: Any, value: int = 0) -> int:
    """CRC-32C of a contiguous buffer, with the CPU's CRC instruction (~5x zlib.crc32 here;
    see csrc/checksum.hpp): for tensor bytes. Releases the GIL."""
    return _C.crc32c(data, value)


_WSUM_PERIOD = 65521
_WSUM_BLOCK = 1 << 22  # int32 words per step: bounds the temporaries


def torch_checksum(t: torch.Tensor) -> int:
    """Position-weighted 64-bit sum of a contiguous tensor's 32-bit words, on its own device.

    Used where the bytes live on an accelerator and a CPU CRC would need a device-to-host copy.
    Any change of a single word changes the sum (the weight times the change is nonzero modulo
    2**64); integer addition wraps, so the value does not depend on the reduction order.
    """
    b = byte_view(t.contiguous())
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
    words = b.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=b.device)
    for start in range(0, words.numel(), _WSUM_BLOCK):
        w = words[start : start + _WSUM_BLOCK].to(torch.int64)
        idx = torch.arange(start, start + w.numel(), dtype=torch.int64, device=b.device)
        weights = idx.remainder_(_WSUM_PERIOD).add_(1)
        total += (w * weights).sum() + w.sum() * 0x9E3779B1
    return int(total.item()) & 0xFFFFFFFFFFFFFFFF
