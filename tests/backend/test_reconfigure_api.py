"""The reconfigure API (torchft-nightly's, torch 2.14's names) on ft's groups: handles,
``reconfigure(opts)``, ``reconfigure_with_store`` and ``ReconfigureOptions``; ``configure()``
keeps working beside it."""

import json
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ft.backend.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroup,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupWrapper,
    ReconfigureOptions,
    _rendezvous,
    reconfigure_with_store,
)
from tests.procs import Workers, make_store


def _opts(uuid, handles):
    opts = ReconfigureOptions()
    opts.uuid = uuid
    opts.handles = handles
    return opts


def test_resize_and_recover_in_place_across_processes():
    # Three processes: all three, then [2, 0], then [1, 2, 0] (a new rank order), then every
    # process again after an abort. The group stays the same object and backend throughout.
    plan = [[0, 1, 2], [2, 0], [1, 2, 0]]
    with Workers("tests.backend.workers:resize_with_handles", 3, plan=plan) as w:
        results = w.join(timeout=90)
    expected = {0: [0, 1, 2, 3], 1: [0, 2, 3], 2: [0, 1, 2, 3]}  # generations taken part in
    for rank, out in enumerate(results):
        gens = [i for i, members in enumerate(plan) if rank in members] + [3]
        assert len(out) == len(gens) == len(expected[rank])
        for (r, size, t, same, _gen, global_ranks), g in zip(out, gens):
            members = plan[g] if g < 3 else [0, 1, 2]
            assert (r, size) == (members.index(rank), len(members))
            assert torch.equal(t, torch.full((2,), float(sum(m + 1 for m in members))))
            assert same
            assert global_ranks == [10 + m for m in members]  # from the handles
        assert [o[4] for o in out] == sorted({o[4] for o in out})  # generations count up


def test_handles_identify_the_group_and_order_the_ranks():
    a, b = ProcessGroupGloo(), ProcessGroupGloo()
    try:
        a.set_rank_info("r0", 0, 1, 3)
        b.set_rank_info("r1", 0, 1, 5)
        handles = [a.get_reconfigure_handle(), b.get_reconfigure_handle()]
        assert handles[0] != handles[1]
        assert a.supports_reconfigure and b.supports_reconfigure
        store = json.loads(handles[0])["store"]
        rdv = _rendezvous(_opts(7, handles), b._handle_id())
        assert (rdv.store_addr, rdv.rank, rdv.world_size) == (f"{store}/torchft/7", 1, 2)
        assert rdv.global_ranks == [3, 5]
        # The id outlives a change of rank info; without a global rank there are none.
        a.set_rank_info("r0", 0, 1, None)
        rdv = _rendezvous(
            _opts(8, [b.get_reconfigure_handle(), a.get_reconfigure_handle()]), a._handle_id()
        )
        assert (rdv.rank, rdv.global_ranks) == (1, None)
        with pytest.raises(ValueError, match="rank order"):
            _rendezvous(_opts(1, set(handles)), a._handle_id())
        with pytest.raises(ValueError, match="not among"):
            _rendezvous(_opts(1, [handles[1]]), a._handle_id())
    finally:
        a.shutdown()
        b.shutdown()


def test_reconfigure_is_bounded_by_its_options_timeout():
    """opts.timeout bounds the rendezvous (a peer that never comes fails it then, not at the
    group's much longer timeout), and the group stays usable afterwards."""
    a, b = ProcessGroupGloo(timeout=timedelta(seconds=60)), ProcessGroupGloo()
    try:
        opts = _opts(3, [a.get_reconfigure_handle(), b.get_reconfigure_handle()])
        opts.timeout = timedelta(milliseconds=500)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="(?i)timeout|timed out|within|connect"):
            a.reconfigure(opts).wait()  # b never takes part
        assert time.monotonic() - t0 < 15
        a.reconfigure(_opts(4, [a.get_reconfigure_handle()])).wait()
        t = torch.ones(2)
        a.allreduce([t]).wait()
        assert a.size() == 1 and torch.equal(t, torch.ones(2))
    finally:
        a.shutdown()
        b.shutdown()


def test_reconfigure_with_store_fails_fast_for_a_missing_peer():
    store = make_store()
    pg = ProcessGroupDummy(0, 1)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        reconfigure_with_store(
            pg, f"127.0.0.1:{store.port}/missing", 0, 2, timedelta(milliseconds=200)
        )
    assert time.monotonic() - t0 < 10
    assert pg.reconfigure_count == 0  # the group was left as it was


def test_reconfigure_with_store_draws_a_new_uuid_each_time():
    store = make_store()
    seen = []

    class Recording(ProcessGroupDummy):
        def reconfigure(self, opts):
            seen.append((opts.uuid, list(opts.handles), opts.timeout))
            return super().reconfigure(opts)

    pg = Recording(0, 1)
    for i in range(2):
        reconfigure_with_store(pg, f"127.0.0.1:{store.port}/{i}", 0, 1, timedelta(seconds=5))
    assert seen[0][0] != seen[1][0]
    assert seen[0][1] == [pg.get_reconfigure_handle()]
    assert seen[0][2] == timedelta(seconds=5)


def test_a_group_with_only_configure_reconfigures_through_it():
    # A group written against torchft 0.2.0's base class (configure only).
    calls = []

    class Old(ProcessGroup):
        def configure(self, store_addr, replica_id, rank, world_size):
            calls.append((store_addr, replica_id, rank, world_size))

    pg = Old(0, 1)
    pg.set_rank_info("replica_9", 0, 1)
    other = json.dumps({"id": "peer", "store": "h:1", "global_rank": None})
    work = pg.reconfigure(_opts(42, [other, pg.get_reconfigure_handle()]))
    assert work.wait()
    assert calls == [("h:1/torchft/42", "replica_9", 1, 2)]


def test_wrappers_reconfigure_the_group_they_wrap():
    inner = ProcessGroupDummy(0, 1)
    wrapper = ErrorSwallowingProcessGroupWrapper(inner)
    wrapper.report_error(RuntimeError("boom"))
    assert wrapper.get_reconfigure_handle() == inner.get_reconfigure_handle()
    wrapper.reconfigure(_opts(1, [wrapper.get_reconfigure_handle()])).wait()
    assert inner.reconfigure_count == 1 and wrapper.error() is None
    plain = ProcessGroupWrapper(pg=inner)
    plain.reconfigure(_opts(2, [plain.get_reconfigure_handle()])).wait()
    assert inner.reconfigure_count == 2


def test_reconfigure_options_are_torchs_where_torch_has_them():
    opts = ReconfigureOptions()
    assert opts.uuid == 0 and opts.timeout is None and dict(opts.hints) == {}
    opts.handles = ["b", "a"]
    assert list(opts.handles) == ["b", "a"]
    native = getattr(torch._C._distributed_c10d, "ReconfigureOptions", None)
    if native is not None:
        assert ReconfigureOptions is native
