"""Bucketing (every element of every tensor is reduced) and quantized allreduce."""

from __future__ import annotations

import pytest
import torch

from ft.collectives import Segment, dequantize_blockwise, plan_buckets, quantize_blockwise
from tests.procs import Workers


def _covers_everything(tensors, buckets):
    seen = [torch.zeros(t.numel(), dtype=torch.int64) for t in tensors]
    for b in buckets:
        assert sum(s.length for s in b.segments) == b.numel
        for s in b.segments:
            assert tensors[s.index].dtype == b.dtype
            seen[s.index][s.tensor_offset : s.tensor_offset + s.length] += 1
    return all(bool((x == 1).all()) for x in seen)


def test_plan_3x3_with_cap_of_4_elements():
    ts = [torch.zeros(3, 3), torch.zeros(3, 3)]
    plan = plan_buckets(ts, cap_bytes=4 * 4)
    assert [b.numel for b in plan] == [4, 4, 4, 4, 2]  # 18 elements, trailing partial kept
    assert plan[2].segments == (Segment(0, 8, 0, 1), Segment(1, 0, 1, 3))
    assert _covers_everything(ts, plan)


@pytest.mark.parametrize("cap", [1, 4, 16, 40, 1000, None])
def test_plan_covers_mixed_dtypes_and_big_tensors(cap):
    ts = [
        torch.zeros(3, 3),
        torch.zeros(20, dtype=torch.float64),
        torch.zeros(0),
        torch.zeros(7, dtype=torch.bfloat16),
        torch.zeros(1),
        torch.zeros(2, 5),
    ]
    plan = plan_buckets(ts, cap)
    assert _covers_everything(ts, plan)
    for b in plan:
        if cap is not None:
            assert b.numel * torch.empty((), dtype=b.dtype).element_size() <= max(
                cap, torch.empty((), dtype=b.dtype).element_size()
            )


def test_quantize_roundtrip_error():
    x = torch.randn(4096)
    q, s = quantize_blockwise(x, 256)
    assert q.dtype == torch.int8 and s.numel() == 16
    y = dequantize_blockwise(q, s, 256)
    assert ((y - x).abs().mean() / x.abs().mean()).item() < 0.01
    z = torch.zeros(256)
    assert torch.equal(dequantize_blockwise(*quantize_blockwise(z, 256), 256), z)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_fp8_roundtrip_error_and_extremes(dtype):
    x = torch.randn(4096) * torch.logspace(-3, 3, 4096)  # widely varying magnitudes
    q, s = quantize_blockwise(x, 256, dtype)
    assert q.dtype == dtype and q.element_size() == 1 and s.numel() == 16
    y = dequantize_blockwise(q, s, 256)
    assert torch.isfinite(y).all()
    # fp8 keeps relative precision: e4m3 has 3 mantissa bits (<= 6.25% per element), e5m2 2.
    bound = 0.0625 if dtype == torch.float8_e4m3fn else 0.125
    big = x.abs() > x.abs().amax() * 1e-2
    assert ((y - x).abs()[big] / x.abs()[big]).max().item() <= bound
    # each block's absmax maps onto the format's largest value, and back (to fp32 rounding)
    assert torch.allclose(y.view(16, 256).abs().amax(1), x.view(16, 256).abs().amax(1), rtol=1e-6)
    z = torch.zeros(256)
    assert torch.equal(dequantize_blockwise(*quantize_blockwise(z, 256, dtype), 256), z)
    with pytest.raises(ValueError, match="wire dtype"):
        quantize_blockwise(x, 256, torch.float16)


def test_bucketed_allreduce_two_processes():
    caps = [16, 4, 36, 1 << 20]  # 4 fp32 elements, one byte-ish, odd, one bucket
    with Workers("tests.diloco.workers:bucketed", 2, cap_bytes_list=caps) as w:
        r0, r1 = w.join(timeout=60)
    for cap in caps:
        assert r0[cap][1] and r1[cap][1], f"cap {cap}: bucketed result differs"
    assert r0[16][0] > 5  # many buckets really were used


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("wire", ["int8", "float8_e4m3fn"])
def test_quantized_allreduce(world, wire):
    n = 30_003  # not a multiple of the block or the world
    with Workers("tests.diloco.workers:quantized", world, n=n, wire=wire) as w:
        results = w.join(timeout=90)
    for op in ("sum", "avg"):
        errs = [r[op]["err"] for r in results]
        assert max(errs) < 0.05, errs
        assert len({r[op]["digest"] for r in results}) == 1  # identical on every rank
        if world == 2:
            ratio = results[0][op]["fp32_bytes"] / results[0][op]["q_bytes"]
            print(
                f"{op}: fp32 {results[0][op]['fp32_bytes']} B, {wire} {results[0][op]['q_bytes']} B, "
                f"ratio {ratio:.2f}, err {max(errs):.4f}"
            )
            assert ratio > 3.5
