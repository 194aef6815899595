"""The safe state-dict encoding: exact round trips, clear errors, hostile headers rejected."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, List

import pytest
import torch


from tests.checkpointing.ckpt_testlib import assert_same, build_state

from ft.checkpointing import serialization as ser  # noqa: E402
from ft.checkpointing.transport import CheckpointFormatError  # noqa: E402


def round_trip(obj: Any) -> Any:
    tree, specs, tensors = ser.flatten(obj)
    header = ser.encode_header(tree, specs)
    _, tree2, specs2 = ser.decode_header(header)
    out: List[torch.Tensor] = []
    for t, s in zip(tensors, specs2):
        r = ser.allocate(s, torch.device("cpu"))
        if r.numel():
            ser.memview(r)[:] = ser.memview(t)  # the bytes, as a transport moves them
        out.append(ser.finalize(r, s))
    return ser.unflatten(tree2, out)


def test_realistic_payload_round_trips_exactly() -> None:
    state = build_state()
    got = round_trip(state)
    assert_same(state, got)
    misc = got["user"]["misc"]
    assert misc["tied_a"] is misc["tied_b"]
    assert got["user"]["model"]._metadata == state["user"]["model"]._metadata
    assert misc["tensors"]["channels_last"].is_contiguous(memory_format=torch.channels_last)
    # int keys of the optimizer state stay ints; param_groups stays a list of dicts
    assert list(got["user"]["optim"]["state"]) == [0, 1, 2, 3, 4, 5, 6]
    assert got["user"]["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_header_is_plain_json_without_pickle() -> None:
    tree, specs, _ = ser.flatten(build_state())
    header = ser.encode_header(tree, specs)
    json.loads(header)  # plain JSON, no NaN/Infinity extensions
    assert b"pickle" not in header


def test_parameters_keep_their_type() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    q = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    got = round_trip({"p": p, "q": q})
    assert type(got["p"]) is torch.nn.Parameter and got["p"].requires_grad
    assert type(got["q"]) is torch.nn.Parameter and not got["q"].requires_grad
    assert torch.equal(got["p"], p)


def test_conjugate_and_negative_views_are_resolved() -> None:
    z = torch.randn(4, dtype=torch.complex64)
    got = round_trip({"c": z.conj()})
    assert torch.equal(got["c"], z.conj().resolve_conj())


@pytest.mark.parametrize(
    "obj,match",
    [
        ({"a": {"b": [0, object()]}}, r"state_dict\['a'\]\['b'\]\[1\]: values of type"),
        ({"a": {1, 2}}, r"\['a'\].*builtins.set"),
        ({"a": torch.randn(4).to_sparse()}, r"\['a'\]: only dense"),
        ({"a": torch.empty(2, device="meta")}, r"\['a'\]: only dense"),
        ({("x", object()): 1}, "dict key"),
        ({"np": __import__("numpy").float32(1.0)}, r"\['np'\].*numpy"),
    ],
)
def test_unsupported_values_raise_type_error_naming_the_path(obj: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        ser.flatten(obj)


def test_defaultdict_and_namedtuple_are_rejected_not_silently_changed() -> None:
    from collections import defaultdict, namedtuple

    with pytest.raises(TypeError, match="defaultdict"):
        ser.flatten({"d": defaultdict(int)})
    P = namedtuple("P", "x y")
    with pytest.raises(TypeError, match="P"):
        ser.flatten({"p": P(1, 2)})


def _header(tree: Any, tensors: List[Any]) -> bytes:
    return json.dumps({"format": ser.FORMAT, "tree": tree, "tensors": tensors}).encode()


GOOD_SPEC = {"dtype": "float32", "shape": [2], "stride": None, "nbytes": 8, "param": False}


@pytest.mark.parametrize(
    "header",
    [
        b"not json",
        b"\xff\xfe",
        json.dumps({"format": "pickle", "tree": ["n"], "tensors": []}).encode(),
        _header(["n"], [dict(GOOD_SPEC, dtype="object")]),
        _header(["n"], [dict(GOOD_SPEC, dtype="qint8")]),
        _header(["n"], [dict(GOOD_SPEC, shape=[-1])]),
        _header(["n"], [dict(GOOD_SPEC, shape=[2.0])]),
        _header(["n"], [dict(GOOD_SPEC, nbytes=9)]),
        _header(["n"], [dict(GOOD_SPEC, shape=[2, 2], nbytes=16, stride=[1, 1])]),
        _header(["n"], [dict(GOOD_SPEC, shape=[2, 2], nbytes=16, stride=[4, 1])]),
        _header(["n"], [dict(GOOD_SPEC, param="yes")]),
        _header(["n"], "x"),
        b"[" * 100000 + b"]" * 100000,
    ],
)
def test_hostile_headers_are_rejected(header: bytes) -> None:
    with pytest.raises(CheckpointFormatError):
        ser.decode_header(header)


@pytest.mark.parametrize(
    "tree",
    [
        ["T", 1],
        ["T", -1],
        ["T", "0"],
        ["x", 1],
        ["i", "1"],
        ["i", 1.5],
        ["f", "not a float"],
        ["y", "***"],
        ["dt", "os.system"],
        ["dv", "nonsense:device"],
        ["d", [[["l", []], ["n"]]]],  # unhashable key
        ["d", [[["dt", "float32"], ["n"]]]],
        ["od", [], ["n"], "extra"],
        ["l", "notalist"],
        {"dict": "node"},
        "string",
    ],
)
def test_hostile_trees_are_rejected(tree: Any) -> None:
    t = torch.zeros(2)
    with pytest.raises(CheckpointFormatError):
        ser.unflatten(tree, [t])


def test_deep_nesting_is_rejected_on_both_sides() -> None:
    deep: Any = 1
    for _ in range(ser.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(TypeError, match="nesting"):
        ser.flatten(deep)
    tree: Any = ["i", 1]
    for _ in range(ser.MAX_DEPTH + 5):
        tree = ["l", [tree]]
    with pytest.raises(CheckpointFormatError, match="deep"):
        ser.unflatten(tree, [])


def test_ordered_dict_vs_dict_preserved() -> None:
    od = OrderedDict([("b", 1), ("a", 2)])
    got = round_trip({"od": od, "d": {"b": 1, "a": 2}})
    assert type(got["od"]) is OrderedDict and list(got["od"]) == ["b", "a"]
    assert type(got["d"]) is dict


def test_torch_checksum_detects_single_changes() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(1 << 16, generator=g)
    base = ser.torch_checksum(t)
    assert ser.torch_checksum(t.clone()) == base
    flat = t.view(torch.uint8)
    for pos in (0, 1, 12345, flat.numel() - 1):
        c = t.clone()
        cf = c.view(torch.uint8)
        cf[pos] ^= 0x80
        assert ser.torch_checksum(c) != base
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert ser.torch_checksum(swapped) != base
    # odd byte counts are padded
    assert ser.torch_checksum(torch.ones(3, dtype=torch.uint8)) != ser.torch_checksum(
        torch.ones(3, dtype=torch.uint8) * 2
    )


def test_crc32c_known_vectors_and_chaining():
    """CRC-32C (the tensor-bytes checksum): the standard check value, chaining across pieces,
    and the same value as a plain-Python reference on unaligned lengths (hardware and table
    paths must agree)."""
    import zlib

    from ft.checkpointing import serialization as ser

    assert ser.crc32c(b"123456789") == 0xE3069283
    assert ser.crc32c(b"") == 0
    assert ser.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros

    def reference(data: bytes) -> int:
        c = 0xFFFFFFFF
        for b in data:
            c ^= b
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        return c ^ 0xFFFFFFFF

    data = bytes(range(256)) * 3 + b"tail"
    for n in (1, 7, 8, 9, 63, 777):
        assert ser.crc32c(data[:n]) == reference(data[:n])
    whole = ser.crc32c(data)
    assert ser.crc32c(data[300:], ser.crc32c(data[:300])) == whole
    assert whole != zlib.crc32(data)  # a different polynomial: v1 peers cannot be confused
    t = torch.arange(1000, dtype=torch.float32)
    assert ser.crc32c(ser.memview(t)) == ser.crc32c(t.numpy().tobytes())
    with pytest.raises(BufferError):
        ser.crc32c(memoryview(t.numpy())[::2])  # strided: refused, not misread


def test_crc32c_three_stream_blocks_match_a_bytewise_reference():
    """Buffers of 12 KiB and more are checksummed as three interleaved streams whose results
    are combined (csrc/checksum.cpp): lengths around the block edges, unaligned starts and
    chaining across a block edge give the same value as a plain table-driven CRC-32C."""
    import random

    from ft.checkpointing import serialization as ser

    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)

    def reference(data: bytes) -> int:
        c = 0xFFFFFFFF
        for b in data:
            c = table[(c ^ b) & 0xFF] ^ (c >> 8)
        return c ^ 0xFFFFFFFF

    rng = random.Random(7)
    data = bytes(rng.getrandbits(8) for _ in range(3 * 12288 + 777))
    block = 3 * 4096
    for n in (block - 1, block, block + 1, block + 9, 2 * block, 3 * block + 5):
        for start in (0, 1, 5):
            piece = data[start : start + n]
            assert ser.crc32c(piece) == reference(piece), (n, start)
    for cut in (1, block - 3, block, block + 11):
        assert ser.crc32c(data[cut:], ser.crc32c(data[:cut])) == reference(data)
