"""Worker functions run in child processes by tests/procs.py."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

import ft
from tests.procs import connect_store

ADDR = "127.0.0.1"


def ft_group(rank, world_size, port, prefix="g0", timeout_s=20.0, num_lanes=2):
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=timeout_s), num_lanes=num_lanes)
    pg.configure(f"{ADDR}:{port}/{prefix}", "test", rank, world_size)
    return pg


def _data(rank, world_size, dtype, n=7, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 3).to(dtype)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def _run_cases(pg, rank, ws, dtype):
    """Every collective once; returns {name: output tensors}. AVG is checked
    against SUM / world_size computed the same way."""
    out = {}
    R = dist.ReduceOp
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX] + ([R.AVG] if dtype.is_floating_point else [])
    for op in ops:
        t = _data(rank, ws, dtype)
        if op == R.AVG and not getattr(pg, "_is_ft", False):
            pg.allreduce([t], dist.AllreduceOptions()).wait()  # SUM
            t.div_(ws)
        else:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            pg.allreduce([t], opts).wait()
        out[f"allreduce_{op}"] = [t]
    ts = [_data(rank, ws, dtype, n=5, salt=1), _data(rank, ws, dtype, n=3, salt=2)]
    pg.allreduce_coalesced(ts, dist.AllreduceCoalescedOptions()).wait()
    out["allreduce_coalesced"] = ts
    for root in range(ws):
        t = _data(rank, ws, dtype, salt=3)
        o = dist.BroadcastOptions()
        o.rootRank = root
        pg.broadcast([t], o).wait()
        out[f"broadcast_{root}"] = [t]
        t = _data(rank, ws, dtype, salt=4)
        o = dist.ReduceOptions()
        o.rootRank = root
        pg.reduce([t], o).wait()
        if rank == root:
            out[f"reduce_{root}"] = [t]
    outs = [[torch.zeros(7, dtype=dtype) for _ in range(ws)]]
    pg.allgather(outs, [_data(rank, ws, dtype)]).wait()
    out["allgather"] = outs[0]
    big = torch.zeros(7 * ws, dtype=dtype)
    pg._allgather_base(big, _data(rank, ws, dtype)).wait()
    out["all_gather_into_tensor"] = [big]
    # gather / scatter to/from root 0
    o = dist.GatherOptions()
    o.rootRank = 0
    gouts = [[torch.zeros(7, dtype=dtype) for _ in range(ws)]] if rank == 0 else []
    pg.gather(gouts, [_data(rank, ws, dtype, salt=5)], o).wait()
    if rank == 0:
        out["gather"] = gouts[0]
    o = dist.ScatterOptions()
    o.rootRank = 0
    sout = torch.zeros(7, dtype=dtype)
    sin = [[_data(r, ws, dtype, salt=6) for r in range(ws)]] if rank == 0 else []
    pg.scatter([sout], sin, o).wait()
    out["scatter"] = [sout]
    rs_out = torch.zeros(4, dtype=dtype)
    pg.reduce_scatter(
        [rs_out],
        [[_data(rank, ws, dtype, n=4, salt=7 + r) for r in range(ws)]],
        dist.ReduceScatterOptions(),
    ).wait()
    out["reduce_scatter"] = [rs_out]
    rsb = torch.zeros(4, dtype=dtype)
    pg._reduce_scatter_base(
        rsb, _data(rank, ws, dtype, n=4 * ws, salt=8), dist.ReduceScatterOptions()
    ).wait()
    out["reduce_scatter_tensor"] = [rsb]
    a2a_out = torch.zeros(3 * ws, dtype=dtype)
    pg.alltoall_base(
        a2a_out, _data(rank, ws, dtype, n=3 * ws, salt=9), [], [], dist.AllToAllOptions()
    ).wait()
    out["all_to_all_single"] = [a2a_out]
    # send/recv around a ring
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    recv_t = torch.zeros(6, dtype=dtype)
    sw = pg.send([_data(rank, ws, dtype, n=6, salt=10)], nxt, 3)
    rw = pg.recv([recv_t], prv, 3)
    sw.wait()
    rw.wait()
    out["send_recv"] = [recv_t]
    pg.barrier().wait()
    return out


def collectives_vs_gloo(rank, world_size, port, dtypes, host_staged=False):
    store = connect_store(port)
    pg = ft_group(rank, world_size, port)
    pg._is_ft = True
    # Host staging (the shared-GPU path) on CPU tensors: every op runs on copies of its
    # tensors, and only its outputs are copied back.
    pg.backend._stage_cpu_ops = host_staged
    ref = dist.ProcessGroupGloo(PrefixStore("ref", store), rank, world_size, timedelta(seconds=20))
    report = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        got = _run_cases(pg, rank, world_size, dtype)
        want = _run_cases(ref, rank, world_size, dtype)
        assert got.keys() == want.keys()
        for case in got:
            same = all(
                torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got[case], want[case])
            )
            report[f"{name}/{case}"] = same
    report["host_staged_ops"] = pg.backend.host_staged_ops
    return report


def torch_api_on_ft(rank, world_size, port, init_method=None):
    """init_process_group("ft") and torch's own collective functions."""
    if init_method:
        dist.init_process_group("ft", init_method=init_method, rank=rank, world_size=world_size)
    else:
        store = connect_store(port)
        dist.init_process_group(
            "ft", store=PrefixStore("default", store), rank=rank, world_size=world_size
        )
    try:
        res = {
            "backend": dist.get_backend(),
            "size": dist.get_world_size(),
            "rank": dist.get_rank(),
        }
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        res["all_reduce"] = t
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        res["avg"] = t
        lst = [torch.zeros(2) for _ in range(world_size)]
        dist.all_gather(lst, torch.full((2,), float(rank)))
        res["all_gather"] = torch.stack(lst)
        o = torch.zeros(2 * world_size)
        dist.all_gather_into_tensor(o, torch.full((2,), float(rank)))
        res["all_gather_into_tensor"] = o
        o = torch.zeros(2)
        dist.reduce_scatter_tensor(o, torch.arange(2.0 * world_size))
        res["reduce_scatter_tensor"] = o
        o = torch.zeros(2)
        dist.reduce_scatter(o, [torch.full((2,), float(r)) for r in range(world_size)])
        res["reduce_scatter"] = o
        b = torch.full((2,), float(rank))
        dist.broadcast(b, src=world_size - 1)
        res["broadcast"] = b
        a2a = torch.zeros(world_size)
        dist.all_to_all_single(a2a, torch.arange(float(world_size)) + 10 * rank)
        res["all_to_all_single"] = a2a
        r = torch.full((2,), float(rank + 1))
        dist.reduce(r, dst=0)
        res["reduce"] = r
        g = [torch.zeros(1) for _ in range(world_size)] if rank == 0 else None
        dist.gather(torch.full((1,), float(rank)), g, dst=0)
        res["gather"] = None if g is None else torch.cat(g)
        s = torch.zeros(1)
        dist.scatter(
            s, [torch.full((1,), float(i)) for i in range(world_size)] if rank == 0 else None, src=0
        )
        res["scatter"] = s
        if rank == 0:
            dist.send(torch.full((2,), 7.0), dst=1)
        elif rank == 1:
            x = torch.zeros(2)
            dist.recv(x, src=0)
            res["recv"] = x
        dist.barrier()
        w = dist.all_reduce(torch.ones(1), async_op=True)
        res["future"] = w.get_future().wait()[0]
        res["completed"] = w.is_completed() and not work_failed(w)
        return res
    finally:
        dist.destroy_process_group()


def work_failed(w) -> bool:
    """Whether a completed Work failed. torch 2.11's binding of Work.exception() cannot
    convert its return value (TypeError), so there a failed Work is one whose wait() raises."""
    try:
        return w.exception() is not None
    except TypeError:
        try:
            w.wait()
        except Exception:
            return True
        return False


def _ddp_run(pg, steps=8, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    rank = pg.rank()
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        y = torch.randn(4, 2, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"params": [p.detach().clone() for p in model.parameters()], "losses": losses}


def ddp_ft_vs_gloo(rank, world_size, port):
    store = connect_store(port)
    pg = ft_group(rank, world_size, port)
    dist.init_process_group(
        "ft", store=PrefixStore("default", store), rank=rank, world_size=world_size
    )
    ref = dist.new_group(backend="gloo")  # torch's own Gloo ProcessGroup
    try:
        return {
            "gloo": _ddp_run(ref),
            "ft_facade": _ddp_run(pg),
            "ft_init": _ddp_run(dist.group.WORLD),
        }
    finally:
        dist.destroy_process_group()


# --- reconfigure -----------------------------------------------------------


def reconfigure_sequence(rank, world_size, port, plan):
    """Follows `plan`, a list of [prefix, {old_rank: new_rank}, new_world_size].

    A rank absent from the mapping leaves. Returns the allreduce result of each
    generation it took part in."""
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=20))
    results = []
    my_rank = rank
    for prefix, mapping, ws in plan:
        mapping = {int(k): v for k, v in mapping.items()}
        if my_rank not in mapping:
            break
        my_rank = mapping[my_rank]
        pg.configure(f"{ADDR}:{port}/{prefix}", "r", my_rank, ws)
        t = torch.full((2,), float(my_rank + 1))
        dist.all_reduce(t, group=pg)
        results.append((prefix, pg.rank(), pg.size(), t))
    return results


def join_late(rank, world_size, port, prefix, new_rank, ws):
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=20))
    pg.configure(f"{ADDR}:{port}/{prefix}", "r", new_rank, ws)
    t = torch.full((2,), float(new_rank + 1))
    dist.all_reduce(t, group=pg)
    return [(prefix, pg.rank(), pg.size(), t)]


def survivor_after_kill(rank, world_size, port):
    """Rank 0 of 3: trains with ranks 1, 2; rank 2 is killed; then regroups
    with rank 1 and a brand-new rank 2."""
    store = connect_store(port)
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=20))
    pg.configure(f"{ADDR}:{port}/gen1", "r", rank, 3)
    t = torch.ones(2)
    dist.all_reduce(t, group=pg)
    store.set(f"ready/{rank}", "1")
    store.wait(["killed"], timedelta(seconds=20))
    failure = None
    try:
        dist.all_reduce(torch.ones(2), group=pg)
    except Exception as e:  # the dead peer
        failure = str(e)
    store.wait(["replacement_started"], timedelta(seconds=20))
    pg.configure(f"{ADDR}:{port}/gen2", "r", rank, 3)
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t, group=pg)
    return {"failure": failure, "errored": repr(pg.errored()), "result": t}


def victim(rank, world_size, port):
    store = connect_store(port)
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=20))
    pg.configure(f"{ADDR}:{port}/gen1", "r", rank, 3)
    dist.all_reduce(torch.ones(2), group=pg)
    store.set(f"ready/{rank}", "1")
    time.sleep(60)  # killed by the test


def replacement(rank, world_size, port):
    store = connect_store(port)
    store.set("replacement_started", "1")
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=20))
    pg.configure(f"{ADDR}:{port}/gen2", "r", rank, 3)
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t, group=pg)
    return {"result": t}


def _counts():
    rss_kb = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_kb": rss_kb,
    }


def _settle(pg, deadline_s=10.0):
    """Waits until the reaper has torn down every old generation."""
    end = time.monotonic() + deadline_s
    while pg.backend._reaper_pending() and time.monotonic() < end:
        time.sleep(0.01)
    time.sleep(0.2)


def reconfigure_leak(rank, world_size, port, rounds):
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=20))
    t = torch.ones(1024)
    for i in range(20):  # warm up allocator, thread pools, store client
        pg.configure(f"{ADDR}:{port}/w{i}", "r", rank, world_size)
        dist.all_reduce(t, group=pg)
    _settle(pg)
    before = _counts()
    times = []
    for i in range(rounds):
        start = time.perf_counter()
        pg.configure(f"{ADDR}:{port}/r{i}", "r", rank, world_size)
        times.append(time.perf_counter() - start)
        dist.all_reduce(t, group=pg)
    _settle(pg)
    after = _counts()
    return {"before": before, "after": after, "median_s": sorted(times)[len(times) // 2]}


# --- failures ----------------------------------------------------------------


def allreduce_until_failure(rank, world_size, port, timeout_s=20.0, numel=1 << 16):
    """Allreduces in a loop; returns how long the failing op took."""
    store = connect_store(port)
    pg = ft_group(rank, world_size, port, timeout_s=timeout_s)
    t = torch.ones(numel)
    store.set(f"looping/{rank}", "1")
    end = time.monotonic() + 60
    while time.monotonic() < end:
        start = time.monotonic()
        try:
            pg.allreduce([t], dist.AllreduceOptions()).wait()
        except Exception as e:
            return {
                "elapsed": time.monotonic() - start,
                "error": str(e),
                "errored": repr(pg.errored()),
            }
    return {"elapsed": None, "error": None}


def stuck_then_check_writes(rank, world_size, port, timeout_s):
    """Rank 0: its allreduce hangs behind a stopped peer until the deadline
    aborts it; then the peer resumes and must not write into our tensor."""
    store = connect_store(port)
    pg = ft_group(rank, world_size, port, timeout_s=timeout_s)
    t = torch.full((1 << 18,), float(rank + 1))
    if rank == 1:
        store.set("peer_ready", "1")
        store.wait(["go"], timedelta(seconds=30))  # the test stops us before this returns
        try:
            pg.allreduce([t], dist.AllreduceOptions()).wait()
        except Exception:
            pass
        return {}
    store.wait(["go"], timedelta(seconds=30))
    start = time.monotonic()
    error = None
    try:
        pg.allreduce([t], dist.AllreduceOptions()).wait()
    except Exception as e:
        error = str(e)
    elapsed = time.monotonic() - start
    snapshot = t.clone()
    store.set("aborted", "1")
    store.wait(["continued"], timedelta(seconds=30))
    time.sleep(1.5)  # the peer has resumed and sent its data by now
    return {
        "elapsed": elapsed,
        "error": error,
        "unchanged": torch.equal(t, snapshot),
        "errored": repr(pg.errored()),
    }


def abort_latency(rank, world_size, port, n_ops=4):
    """Rank 0 issues ops the peer never joins, then abort() from another
    thread; returns the time until every pending Work failed."""
    store = connect_store(port)
    pg = ft_group(rank, world_size, port, timeout_s=30)
    if rank == 1:
        store.wait(["done"], timedelta(seconds=30))
        return {}
    works = []
    for i in range(n_ops):
        with ft.lane(i % pg.num_lanes):
            works.append(pg.allreduce([torch.ones(16)], dist.AllreduceOptions()))
    time.sleep(0.2)
    pending_before = sum(not w.is_completed() for w in works)
    failed_at = []

    def aborter():
        pg.abort()

    start = time.monotonic()
    threading.Thread(target=aborter).start()
    for w in works:
        try:
            w.wait()
        except Exception:
            pass
        failed_at.append(time.monotonic() - start)
    store.set("done", "1")
    return {
        "pending_before": pending_before,
        "latency": max(failed_at),
        "all_failed": all(work_failed(w) for w in works),
        "errored": repr(pg.errored()),
    }


def per_op_deadlines(
    rank, world_size, port, group_timeout_s=30.0, op_timeout_s=1.0, set_timeout_s=1.5
):
    """Rank 0 issues allreduces rank 1 never joins. The first carries its own timeout
    (shorter than the group's); after a reconfigure, set_timeout() shortens the group's,
    and the next op (no timeout of its own) must fail at that one."""
    store = connect_store(port)
    pg = ft_group(rank, world_size, port, prefix="deadline0", timeout_s=group_timeout_s)
    if rank == 1:
        store.wait(["reconfigure"], timedelta(seconds=60))
        pg.configure(f"{ADDR}:{port}/deadline1", "test", rank, world_size)
        store.wait(["done"], timedelta(seconds=60))
        return {}
    res = {}

    def timed_failure(key, opts):
        start = time.monotonic()
        try:
            pg.allreduce([torch.ones(4)], opts).wait()
            res[f"{key}_error"] = None
        except Exception as e:
            res[f"{key}_error"] = str(e)
        res[f"{key}_elapsed"] = time.monotonic() - start
        res[f"{key}_errored"] = repr(pg.errored())

    opts = dist.AllreduceOptions()
    opts.timeout = timedelta(seconds=op_timeout_s)
    timed_failure("per_op", opts)
    store.set("reconfigure", "1")
    pg.configure(f"{ADDR}:{port}/deadline1", "test", rank, world_size)
    pg.set_timeout(timedelta(seconds=set_timeout_s))
    timed_failure("set_timeout", dist.AllreduceOptions())
    store.set("done", "1")
    return res


# --- one process, several groups or ranks: an abort cuts only its own sockets ---


def _bounded(fn, timeout_s, what):
    """Runs ``fn`` on a thread; its result, or AssertionError naming ``what`` after
    ``timeout_s``. The exception ``fn`` raised is raised here."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name=what)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise AssertionError(f"{what} did not finish within {timeout_s}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _wait_for_new_key(store, baseline, timeout_s, what):
    """Waits until the store holds more than ``baseline`` keys: the configure() started on
    another thread has written its first one (its lane 0's Gloo address), so it is past
    building that lane's Gloo device and waits for its peers."""
    end = time.monotonic() + timeout_s
    while store.num_keys() <= baseline:
        if time.monotonic() > end:
            raise AssertionError(f"{what}: no new store key within {timeout_s}s")
        time.sleep(0.005)


def _error_of(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - the test reads the text
        return f"{type(e).__name__}: {e}"


def ranks_as_threads_one_shuts_down(rank, world_size, port, timeout_s=10.0):
    """torchft's test_collective_with_resiliency(send/recv), in one process: ranks 0, 1, 2 of
    one group are threads here. Rank 2 starts configuring first (its connect is in flight
    while ranks 0 and 1 build their Gloo devices), then shuts down at once; ranks 0 and 1
    then send/recv, and regroup as a world of 2."""
    store = connect_store(port)
    pgs = [ft.ProcessGroupGloo(timeout=timedelta(seconds=timeout_s)) for _ in range(3)]
    res = {}

    def configure(r, prefix, ws):
        return threading.Thread(
            target=lambda: pgs[r].configure(f"{ADDR}:{port}/{prefix}", "test", r, ws),
            daemon=True,
        )

    baseline = store.num_keys()
    threads = [configure(2, "all3", 3)]
    threads[0].start()
    _wait_for_new_key(store, baseline, timeout_s, "rank 2's configure")
    threads += [configure(0, "all3", 3), configure(1, "all3", 3)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "configure of 3 ranks did not finish"

    pgs[2].shutdown()  # the "crashed" rank: its sockets, and only those, are cut

    got = torch.zeros(2)

    def send():
        pgs[0].send([torch.full((2,), 7.0)], 1, 0).wait()

    def recv():
        pgs[1].recv([got], 0, 0).wait()

    sender = threading.Thread(target=lambda: res.__setitem__("send_error", _error_of(send)))
    sender.start()
    res["recv_error"] = _bounded(lambda: _error_of(recv), 2 * timeout_s, "recv")
    sender.join(2 * timeout_s)
    assert not sender.is_alive(), "send did not finish"
    res["received"] = got

    # The survivors regroup without rank 2 and allreduce.
    threads = [configure(0, "survivors", 2), configure(1, "survivors", 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "configure of the survivors did not finish"
    sums = [torch.full((2,), float(r + 1)) for r in range(2)]
    ops = [
        threading.Thread(target=lambda r=r: dist.all_reduce(sums[r], group=pgs[r]))
        for r in range(2)
    ]
    for t in ops:
        t.start()
    for t in ops:
        t.join(2 * timeout_s)
        assert not t.is_alive(), "the survivors' allreduce did not finish"
    res["sums"] = sums
    for pg in pgs[:2]:
        pg.shutdown()
    return res


def two_groups_one_shuts_down(rank, world_size, port, timeout_s=10.0):
    """Two ft groups, A and B, over the same two processes (a parameter server's concurrent
    sessions, say). In rank 0's process, B connects while A's configure is in flight (rank 1
    joins A only after B). Rank 0 then shuts A down: rank 1's op on A fails (its peer is
    gone), and B, in both processes, must keep working: send/recv, allreduce, reconfigure."""
    store = connect_store(port)
    a = ft.ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
    b = ft.ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
    wait = timedelta(seconds=3 * timeout_s)
    res = {}
    if rank == 0:
        store.wait(["idle/1"], wait)
        baseline = store.num_keys()
        a_configure = threading.Thread(
            target=lambda: a.configure(f"{ADDR}:{port}/a", "test", 0, 2), daemon=True
        )
        a_configure.start()
        _wait_for_new_key(store, baseline, timeout_s, "A's configure")
        store.set("a_in_flight", "1")
        b.configure(f"{ADDR}:{port}/b", "test", 0, 2)
        a_configure.join(2 * timeout_s)
        assert not a_configure.is_alive(), "A's configure did not finish"
    else:
        store.set("idle/1", "1")
        store.wait(["a_in_flight"], wait)
        b.configure(f"{ADDR}:{port}/b", "test", 1, 2)
        a.configure(f"{ADDR}:{port}/a", "test", 1, 2)
    for pg in (a, b):
        t = torch.ones(2)
        dist.all_reduce(t, group=pg)
        assert torch.equal(t, torch.full((2,), 2.0)), t

    if rank == 0:
        a.shutdown()
        store.set("a_shut", "1")
    else:
        store.wait(["a_shut"], wait)
        start = time.monotonic()
        res["a_error"] = _error_of(lambda: dist.all_reduce(torch.ones(2), group=a))
        res["a_error_after_s"] = time.monotonic() - start

    peer = 1 - rank
    got = torch.zeros(3)

    def send_recv():
        # Rank 0 sends first, rank 1 receives first: one exchange each way.
        mine = torch.full((3,), float(rank + 1))
        if rank == 0:
            b.send([mine], peer, 5).wait()
            b.recv([got], peer, 6).wait()
        else:
            b.recv([got], peer, 5).wait()
            b.send([mine], peer, 6).wait()

    res["b_send_recv_error"] = _error_of(send_recv)
    res["b_received"] = got
    t = torch.full((2,), float(rank + 1))
    res["b_allreduce_error"] = _error_of(lambda: dist.all_reduce(t, group=b))
    res["b_sum"] = t
    res["b_errored"] = repr(b.errored())
    b.configure(f"{ADDR}:{port}/b2", "test", rank, 2)
    u = torch.full((2,), float(rank + 1))
    dist.all_reduce(u, group=b)
    res["b2_sum"] = u
    b.shutdown()
    if rank == 1:
        a.shutdown()
    return res


# --- lanes -------------------------------------------------------------------


def lanes_independent(rank, world_size, port):
    """Rank 0 issues an op on lane 0 that rank 1 has not joined; an op on
    lane 1 must still complete. Then rank 1 joins lane 0."""
    store = connect_store(port)
    pg = ft_group(rank, world_size, port, timeout_s=20)
    res = {}
    if rank == 0:
        stuck = pg.allreduce([torch.ones(4)], dist.AllreduceOptions())
        store.set("lane0_issued", "1")
        with ft.lane(1):
            t = torch.full((4,), 2.0)
            start = time.monotonic()
            pg.allreduce([t], dist.AllreduceOptions()).wait()
            res["lane1_elapsed"] = time.monotonic() - start
            res["lane1_result"] = t
        res["lane0_completed_before_peer"] = stuck.is_completed()
        store.set("lane1_done", "1")
        stuck.wait()
        res["lane0_result"] = stuck.result()[0]
    else:
        store.wait(["lane0_issued"], timedelta(seconds=20))
        with ft.lane(1):
            pg.allreduce([torch.full((4,), 2.0)], dist.AllreduceOptions()).wait()
        store.wait(["lane1_done"], timedelta(seconds=20))
        pg.allreduce([torch.ones(4)], dist.AllreduceOptions()).wait()
    return res


# --- bad input ---------------------------------------------------------------


def bad_input(rank, world_size, port):
    """Every local misuse raises a clear error and the group keeps working."""
    errors = {}

    def expect(name, fn):
        try:
            fn()
            errors[name] = None
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"

    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=5))
    expect("before_configure", lambda: pg.allreduce([torch.ones(2)], dist.AllreduceOptions()))
    expect(
        "rank_out_of_range", lambda: pg.configure(f"{ADDR}:{port}/x", "r", world_size, world_size)
    )
    expect("negative_rank", lambda: pg.configure(f"{ADDR}:{port}/x", "r", -1, world_size))
    expect("world_size_zero", lambda: pg.configure(f"{ADDR}:{port}/x", "r", 0, 0))
    expect("bad_store_addr", lambda: pg.configure("no-port-here", "r", rank, world_size))
    expect("num_lanes_zero", lambda: ft.ProcessGroupGloo(num_lanes=0))
    start = time.monotonic()
    unreachable = ft.ProcessGroupGloo(timeout=timedelta(seconds=1))
    from tests.procs import free_port

    expect("unreachable_store", lambda: unreachable.configure(f"{ADDR}:{free_port()}/x", "r", 0, 2))
    errors["unreachable_elapsed"] = time.monotonic() - start

    pg.configure(f"{ADDR}:{port}/good", "r", rank, world_size)
    opts = dist.AllreduceOptions()
    expect("non_contiguous", lambda: pg.allreduce([torch.ones(4, 4).t()], opts))
    expect(
        "mixed_dtypes",
        lambda: pg.allreduce([torch.ones(2), torch.ones(2, dtype=torch.float64)], opts),
    )
    expect("sparse", lambda: pg.allreduce([torch.ones(2).to_sparse()], opts))
    expect("meta_device", lambda: pg.allreduce([torch.ones(2, device="meta")], opts))
    avg = dist.AllreduceOptions()
    avg.reduceOp = dist.ReduceOp.AVG
    expect("avg_on_int", lambda: pg.allreduce([torch.ones(2, dtype=torch.int32)], avg))
    premul = dist.AllreduceOptions()
    premul.reduceOp = dist._make_nccl_premul_sum(2.0)
    expect("premul_sum", lambda: pg.allreduce([torch.ones(2)], premul))
    bo = dist.BroadcastOptions()
    bo.rootRank = world_size
    expect("broadcast_bad_root", lambda: pg.broadcast([torch.ones(2)], bo))
    expect("send_to_self", lambda: pg.send([torch.ones(2)], rank, 0))
    expect("send_out_of_range", lambda: pg.send([torch.ones(2)], world_size + 3, 0))

    def bad_lane():
        with ft.lane(7):
            pg.allreduce([torch.ones(2)], opts)

    expect("lane_out_of_range", bad_lane)
    expect("all_gather_into_tensor_size", lambda: pg._allgather_base(torch.zeros(3), torch.ones(2)))
    # The group still works after all of that.
    t = torch.full((3,), float(rank + 1))
    pg.allreduce([t], opts).wait()
    errors["still_works"] = t
    errors["errored_after"] = pg.errored()
    return errors


def mismatched_sizes(rank, world_size, port):
    """Ranks pass different sizes, then different dtypes."""
    pg = ft_group(rank, world_size, port, prefix="mm", timeout_s=5)
    res = {}
    try:
        pg.allreduce([torch.ones(4 + 4 * rank)], dist.AllreduceOptions()).wait()
        res["error"] = None
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
    res["errored"] = repr(pg.errored())
    t = torch.ones(2)
    pg.allreduce([t], dist.AllreduceOptions()).wait()
    res["same_generation_after"] = t
    try:
        pg.allreduce(
            [torch.ones(2, dtype=torch.float32 if rank == 0 else torch.float64)],
            dist.AllreduceOptions(),
        ).wait()
        res["dtype_error"] = None
    except Exception as e:
        res["dtype_error"] = f"{type(e).__name__}: {e}"
    return res


def configure_after_shutdown(rank, world_size, port):
    """configure → allreduce → shutdown → (ops fail) → configure again → allreduce."""
    pg = ft_group(rank, world_size, port, prefix="before")
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)
    pg.shutdown()
    after_shutdown = None
    try:
        dist.all_reduce(torch.ones(3), group=pg)
    except Exception as e:  # noqa: BLE001
        after_shutdown = type(e).__name__
    pg.configure(f"{ADDR}:{port}/after", "test", rank, world_size)
    u = torch.full((3,), float(rank + 1))
    dist.all_reduce(u, group=pg)
    return t, after_shutdown, u, pg.errored()


def resize_with_handles(rank, world_size, port, plan):
    """Rebuilds one ProcessGroupGloo through the reconfigure API (reconfigure_with_store) for
    each member list in `plan` (old ranks, in new rank order), then aborts it and rebuilds it
    with every process. Returns, per generation taken part in: (rank, size, allreduce result,
    same object, backend generation)."""
    from ft.backend.process_group import reconfigure_with_store

    timeout = timedelta(seconds=20)
    store = connect_store(port)
    pg = ft.ProcessGroupGloo(timeout=timeout)
    pg.set_rank_info(f"replica_{rank}", 0, 1, global_rank=10 + rank)
    first = pg
    out = []

    def step(members, tag):
        reconfigure_with_store(
            pg, f"{ADDR}:{port}/{tag}", members.index(rank), len(members), timeout
        )
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t, group=pg)
        out.append((pg.rank(), pg.size(), t, pg is first, pg.backend.generation(), pg.global_ranks))

    for i, members in enumerate(plan):
        if rank in members:
            step(members, f"resize/{i}")
        store.set(f"done/{i}/{rank}", "1")
        store.wait([f"done/{i}/{r}" for r in range(world_size)], timeout)
    pg.abort()
    step(list(range(world_size)), "recovery")
    pg.shutdown()
    return out
