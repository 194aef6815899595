"""Bad input: a clear error naming the problem, and the group stays usable."""

import pytest
import torch

from tests.procs import Workers


def test_local_misuse_is_rejected_clearly_and_group_keeps_working():
    ws = 2
    with Workers("tests.backend.workers:bad_input", ws) as w:
        results = w.join(timeout=60)
    expected = {
        "before_configure": "before configure",
        "rank_out_of_range": "out of range",
        "negative_rank": "out of range",
        "world_size_zero": "world_size",
        "bad_store_addr": "host:port/prefix",
        "num_lanes_zero": "num_lanes",
        "unreachable_store": "cannot reach the store",
        "non_contiguous": "contiguous",
        "mixed_dtypes": "one dtype",
        "sparse": "dense",
        "avg_on_int": "AVG needs floating-point",
        "premul_sum": "PREMUL_SUM",
        "broadcast_bad_root": "root rank",
        "send_to_self": "destination rank",
        "send_out_of_range": "destination rank",
        "lane_out_of_range": "lane 7 does not exist",
        "all_gather_into_tensor_size": "all_gather_into_tensor",
    }
    for r in results:
        for case, needle in expected.items():
            assert r[case] is not None, f"{case}: no error raised"
            assert needle in r[case], f"{case}: {r[case]}"
        assert r["unreachable_elapsed"] < 5.0
        assert torch.equal(r["still_works"], torch.full((3,), 3.0))
        assert r["errored_after"] is None


def test_mismatched_sizes_across_ranks_are_caught_before_any_data_moves():
    # Without the agreement check Gloo terminates the process on a size
    # mismatch (as torch's own Gloo group does); with it, every rank gets a
    # clear error and the group stays usable.
    with Workers("tests.backend.workers:mismatched_sizes", 2, env={"FT_CHECK_AGREEMENT": "1"}) as w:
        results = w.join(timeout=60)
    for r in results:
        assert r["error"].startswith("ValueError"), r
        assert (
            "ranks disagree" in r["error"]
            and "4 elements" in r["error"]
            and "8 elements" in r["error"]
        ), r
        assert r["errored"] == "None", r
        assert torch.equal(r["same_generation_after"], torch.full((2,), 2.0))
        assert r["dtype_error"].startswith("ValueError") and "Float" in r["dtype_error"], r


def test_shared_gpu_policy_is_checked_and_reaches_the_backend(monkeypatch):
    import ft

    assert ft.ProcessGroupGloo().backend.host_stage_shared_gpu is True  # the default
    assert ft.ProcessGroupGloo(shared_gpu="error").backend.host_stage_shared_gpu is False
    monkeypatch.setenv("FT_SHARED_GPU", "error")
    assert ft.ProcessGroupGloo().backend.host_stage_shared_gpu is False
    assert ft.ProcessGroupGloo(shared_gpu="host-staged").backend.host_stage_shared_gpu is True
    with pytest.raises(ValueError, match="shared_gpu .* must be one of"):
        ft.ProcessGroupGloo(shared_gpu="maybe")
