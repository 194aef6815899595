"""Fault-tolerant training orchestrated by Monarch, with ft: kill a trainer, restart its group.

One controller process (this script) uses Monarch (``pip install torchmonarch``) to run:

* a lighthouse: one process with a ``LighthouseActor`` that serves
  ``ft.coordination.LighthouseServer`` (bound to 127.0.0.1 by default);
* N replica groups: one proc mesh of ``--ranks-per-group`` processes per group, each process
  with a ``TrainerActor`` that trains a small classifier under ``ft.Manager`` (gloo process
  group, ``ft.DistributedDataParallel``, ``ft.Optimizer``) and, at the end, returns a sha256
  over its model and optimizer state.

With ``--kill-at-step K`` one trainer process of one group (``--kill-replica``,
``--kill-rank``) kills itself hard at step K (SIGKILL of its own pid, or ``os._exit(1)``). The
controller sees that group's ``train`` call fail, stops the group's proc mesh and spawns a new one
for the same replica id. Meanwhile the other groups carry on without it; when the new group
joins a quorum, ft's Manager heals it from a live peer (the live state, not a checkpoint file)
and all groups finish the same steps with the same state.

Run it (CPU, one host)::

    python examples/monarch/train_distributed.py --replica-count 2 --ranks-per-group 2 \\
        --steps 100 --kill-at-step 20

It exits 0 when every rank of every group reports the same state hash at the same final step
(and, with ``--kill-at-step``, when exactly the killed group was restarted and healed); it prints
a summary and a ``RESULT {...}`` JSON line (also written to ``--summary-json``). Every wait has a
deadline (``--deadline``) and every proc mesh is stopped at the end, on error too.

Where to point it at a cluster: ``spawn_host_mesh`` below is the one place that picks the hosts
(``this_host()`` here); see examples/monarch/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import signal
import socket
import sys
import time
import urllib.parse
from typing import Any, Dict, List, Optional

# How often Monarch checks the processes of a mesh, which is how soon the controller learns that
# a trainer died: 1 s instead of Monarch's default of 10 s. Monarch reads it when it is imported.
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

from monarch.actor import Actor, current_rank, endpoint, this_host  # noqa: E402

# ---------------------------------------------------------------------------------------------
# where ft comes from

# In a source checkout (ft not installed), the repository root holds the package: put it on
# sys.path here and on PYTHONPATH for the processes Monarch spawns (they inherit this
# environment). The same for examples/, which holds what the examples share (common.py: the
# task, the model, the state hash, the stop rule).
_EXAMPLES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REPO_ROOT = os.path.dirname(_EXAMPLES)


def _put_on_path(folder: str) -> None:
    sys.path.insert(0, folder)
    parts = [folder] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)


def _make_ft_importable() -> None:
    if importlib.util.find_spec("ft") is not None:
        return
    if not os.path.isfile(os.path.join(_REPO_ROOT, "ft", "__init__.py")):
        raise SystemExit("ft is not importable: pip install ft, or run from a source checkout")
    _put_on_path(_REPO_ROOT)


_put_on_path(_EXAMPLES)


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# the lighthouse


class LighthouseActor(Actor):
    """Serves ft's lighthouse in its own process."""

    def __init__(self) -> None:
        self.server: Any = None

    @endpoint
    def start_lighthouse(self, bind: str, min_replicas: int, join_timeout_ms: int) -> str:
        from ft.coordination import LighthouseServer

        self.server = LighthouseServer(
            bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms
        )
        return self.server.address()

    @endpoint
    def stop_lighthouse(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None


# ---------------------------------------------------------------------------------------------
# the trainers


def _batch(step: int, replica_id: int, rank: int, size: int):
    """A deterministic batch of three-spiral points for this step, group and rank: a group
    restarted at a later step trains on exactly what it would have had."""
    import torch
    from common import NUM_CLASSES, spiral_points

    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * replica_id + rank)
    y = torch.randint(0, NUM_CLASSES, (size,), generator=g)
    return spiral_points(y, g, noise=0.05), y


class _HealLog(logging.Handler):
    """Collects the Manager's ``heal_recv`` events (the step a heal brought, and from whom)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.heals: List[Dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "ft", None)
        if isinstance(fields, dict) and fields.get("event") == "heal_recv":
            self.heals.append(
                {"to_step": fields.get("max_step"), "message": str(record.args[-1])[:200]}
            )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die(mode: str) -> None:
    if mode == "exit":
        os._exit(1)
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # SIGKILL is delivered before this returns


class TrainerActor(Actor):
    """One rank of one replica group. ``setup`` builds the Manager (its group's store, its
    lighthouse connection); ``train`` runs the loop and returns this rank's report."""

    def __init__(self, cfg: Dict[str, Any], replica_id: int, attempt: int):
        self.cfg = cfg
        self.replica_id = replica_id
        self.attempt = attempt
        self.rank = current_rank().rank
        self.world_size = cfg["ranks_per_group"]
        self.tag = f"[replica {replica_id} rank {self.rank} attempt {attempt} pid {os.getpid()}]"

    @endpoint
    def store_address(self, loopback: bool) -> Dict[str, Any]:
        """Where this rank would host its group's stores: this host, and two ports free on it
        (the Manager's store, and the store of the group's own gloo group). The controller
        takes group rank 0's answer."""
        host = "127.0.0.1" if loopback else socket.getfqdn()
        return {"rank": self.rank, "host": host, "ports": [_free_port(host), _free_port(host)]}

    @endpoint
    def setup(self, lighthouse: str, store_host: str, ports: List[int]) -> int:
        # The environment ft (and torch.distributed) read, set before the Manager exists.
        os.environ.update(
            {
                "REPLICA_GROUP_ID": str(self.replica_id),
                "NUM_REPLICA_GROUPS": str(self.cfg["replica_count"]),
                "RANK": str(self.rank),
                "LOCAL_RANK": str(self.rank),
                "WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": store_host,
                "MASTER_PORT": str(ports[0]),
                "TORCHFT_LIGHTHOUSE": lighthouse,
            }
        )
        from datetime import timedelta

        import torch
        from common import init_group_pg, make_model, setup_logging

        import ft

        torch.set_num_threads(1)
        setup_logging(logging.WARNING)
        for handler in logging.getLogger().handlers:
            handler.setLevel(logging.WARNING)
        self.heal_log = _HealLog()
        ft_log = logging.getLogger("ft.manager")
        ft_log.setLevel(logging.INFO)
        ft_log.addHandler(self.heal_log)

        cfg = self.cfg
        torch.manual_seed(cfg["seed"])  # the same initial weights everywhere
        self.net = make_model(64)
        self.inner_opt = torch.optim.AdamW(self.net.parameters(), lr=cfg["lr"])

        # The ranks of one group also average among themselves, over a plain gloo group.
        self.group_pg = None
        if self.world_size > 1:
            self.group_pg = init_group_pg(store_host, ports[1], self.rank, self.world_size, 60.0)

        def load_state_dict(sd: Dict[str, Any]) -> None:
            self.net.load_state_dict(sd["model"])
            self.inner_opt.load_state_dict(sd["optim"])

        def state_dict() -> Dict[str, Any]:
            return {"model": self.net.state_dict(), "optim": self.inner_opt.state_dict()}

        timeout = timedelta(seconds=cfg["timeout"])
        self.manager = ft.Manager(
            pg=ft.ProcessGroupGloo(timeout=timeout),
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=cfg["min_replicas"],
            use_async_quorum=False,
            replica_id=f"monarch_{self.replica_id}",
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg["quorum_timeout"]),
        )
        self.model = ft.DistributedDataParallel(self.manager, self.net)
        self.optimizer = ft.Optimizer(self.manager, self.inner_opt)
        log(f"{self.tag} ready (store {store_host}:{ports[0]}, lighthouse {lighthouse})")
        return os.getpid()

    @endpoint
    def train(self) -> Dict[str, Any]:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from common import StopRule, average_in_group, state_hash

        cfg, manager = self.cfg, self.manager
        steps, groups = cfg["steps"], cfg["replica_count"]
        kill_here = (
            cfg["kill_at_step"] is not None
            and self.attempt == 0
            and self.replica_id == cfg["kill_replica"]
            and self.rank == cfg["kill_rank"]
        )
        t0 = time.monotonic()
        stop = StopRule(steps, groups, cfg["final_wait"])
        seen_heals = 0
        failed_steps = 0
        last_quorum: Optional[int] = None
        while True:
            self.optimizer.zero_grad()  # the quorum; a heal happens here (sync quorum)
            step = manager.current_step()
            for heal in self.heal_log.heals[seen_heals:]:
                log(f"{self.tag} healed from a live peer to step {heal['to_step']}")
            seen_heals = len(self.heal_log.heals)
            participants = manager.num_participants()
            if participants != last_quorum and self.rank == 0:
                log(f"{self.tag} step {step}: {participants} of {groups} groups participate")
            last_quorum = participants

            if kill_here and step >= cfg["kill_at_step"]:
                log(f"{self.tag} INJECTING FAILURE at step {step}: {cfg['kill_mode']}")
                _die(cfg["kill_mode"])

            # Stop once `steps` are done and every group is back (or --final-wait has passed);
            # the flags are averaged below, so every participant decides alike.
            at_end, want_stop = stop(step, participants)

            xb, yb = _batch(step, self.replica_id, self.rank, cfg["batch_size"])
            loss = F.cross_entropy(self.model(xb), yb)
            loss.backward()  # gradients averaged over the participating groups

            ctrl = torch.tensor([float(want_stop), float(at_end), loss.item()])
            manager.allreduce(ctrl).wait()
            if self.group_pg is not None:
                grads = [p.grad for p in self.net.parameters() if p.grad is not None]
                average_in_group([ctrl, *grads], self.world_size, self.group_pg)
            stop_now, end_now, mean_loss = (float(v) for v in ctrl.tolist())

            if stop_now > 0 or end_now > 0:
                # No update past `steps`: a barrier step that shows every participant agrees.
                if manager.should_commit() and stop_now > 0:
                    break
                time.sleep(0.05)
                continue

            self.optimizer.step()  # commits only if every participant succeeded
            if manager.current_step() <= step:
                failed_steps += 1
            elif self.rank == 0 and step % cfg["log_every"] == 0:
                log(f"{self.tag} step {step}: loss {mean_loss:.4f}")
            if cfg["step_sleep"]:
                time.sleep(cfg["step_sleep"])

        digest = state_hash(self.net, self.inner_opt)
        report = {
            "replica": self.replica_id,
            "rank": self.rank,
            "attempt": self.attempt,
            "pid": os.getpid(),
            "final_step": manager.current_step(),
            "hash": digest,
            "heals": list(self.heal_log.heals),
            "failed_steps": failed_steps,
            "loss": round(mean_loss, 5),
            "train_s": round(time.monotonic() - t0, 2),
        }
        log(f"{self.tag} done at step {report['final_step']}: state sha256 {digest[:16]}")
        # Peers may still be reading our last allreduce: stay connected a moment.
        time.sleep(cfg["exit_linger"])
        manager.shutdown()
        if self.group_pg is not None:
            dist.destroy_process_group()
        return report


# ---------------------------------------------------------------------------------------------
# the controller


def _is_loopback(address: str) -> bool:
    host = urllib.parse.urlsplit(address).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def spawn_host_mesh():
    """The hosts the job runs on: this one. On a cluster, return a HostMesh from a scheduler
    (for example ``monarch.job.SlurmJob(...).state().<mesh>``) instead."""
    return this_host()


class Controller:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.deadline = time.monotonic() + args.deadline
        self.meshes: Dict[str, Any] = {}  # name -> live proc mesh (all stopped by run())
        self.failures: List[Dict[str, Any]] = []
        self.lighthouse_failed = asyncio.Event()
        self.ready: Dict[int, bool] = {}
        self.all_ready = asyncio.Event()
        self.cfg = {
            k: getattr(args, k)
            for k in (
                "replica_count",
                "ranks_per_group",
                "steps",
                "min_replicas",
                "timeout",
                "quorum_timeout",
                "final_wait",
                "exit_linger",
                "step_sleep",
                "batch_size",
                "lr",
                "seed",
                "kill_at_step",
                "kill_replica",
                "kill_rank",
                "kill_mode",
                "log_every",
            )
        }

    def left(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"--deadline {self.args.deadline}s passed")
        return remaining

    def on_fault(self, failure: Any) -> None:
        """Monarch's unhandled-fault hook: a process of ours died. The replica task whose call
        failed restarts it; here we only say so (returning marks the fault handled, instead of
        Monarch's default of ending this controller)."""
        name = getattr(failure, "mesh_name", "?")
        first = str(failure.report()).strip().splitlines()
        log(f"[controller] monarch reports a failure on {name}: {' '.join(first[:2])}")
        if "lighthouse" in str(name) or "lighthouse" in " ".join(first[:2]):
            self.lighthouse_failed.set()

    async def stop_mesh(self, name: str) -> None:
        mesh = self.meshes.pop(name, None)
        if mesh is None:
            return
        try:
            await asyncio.wait_for(mesh.stop(), timeout=30)
        except Exception as e:  # noqa: BLE001 - a mesh whose process died may fail to stop
            log(f"[controller] stopping {name}: {type(e).__name__}: {e}")

    async def start_lighthouse(self) -> str:
        mesh = spawn_host_mesh().spawn_procs(per_host={"procs": 1}, name="lighthouse")
        self.meshes["lighthouse"] = mesh
        self.lighthouse = mesh.spawn("lighthouse", LighthouseActor)
        addr = await asyncio.wait_for(
            self.lighthouse.start_lighthouse.call_one(
                self.args.lighthouse_bind, self.args.min_replicas, self.args.join_timeout_ms
            ),
            timeout=min(60, self.left()),
        )
        log(f"[controller] lighthouse at {addr}")
        return addr

    async def run_replica(self, rid: int, lighthouse: str) -> List[Dict[str, Any]]:
        """Runs replica group ``rid`` until it finishes; restarts it on a new proc mesh when
        one of its processes fails."""
        attempt = 0
        while True:
            name = f"replica{rid}-attempt{attempt}"
            t0 = time.monotonic()
            mesh = spawn_host_mesh().spawn_procs(
                per_host={"ranks": self.args.ranks_per_group}, name=name
            )
            self.meshes[name] = mesh
            try:
                trainers = mesh.spawn("trainer", TrainerActor, self.cfg, rid, attempt)
                answers = await asyncio.wait_for(
                    trainers.store_address.call(_is_loopback(lighthouse)), timeout=self.left()
                )
                rank0 = next(a for a in answers.values() if a["rank"] == 0)
                await asyncio.wait_for(
                    trainers.setup.call(lighthouse, rank0["host"], rank0["ports"]),
                    timeout=self.left(),
                )
                log(f"[controller] {name} up in {time.monotonic() - t0:.1f}s")
                if not self.all_ready.is_set():
                    # Let the first quorum hold every group: start together, or after 60 s.
                    self.ready[rid] = True
                    if len(self.ready) == self.args.replica_count:
                        self.all_ready.set()
                    try:
                        await asyncio.wait_for(self.all_ready.wait(), min(60, self.left()))
                    except asyncio.TimeoutError:
                        log(f"[controller] {name}: not every group is up; starting anyway")
                reports = await asyncio.wait_for(trainers.train.call(), timeout=self.left())
                out = list(reports.values())
                log(f"[controller] {name} finished")
                return out
            except (asyncio.TimeoutError, TimeoutError):
                raise TimeoutError(f"{name}: --deadline {self.args.deadline}s passed") from None
            except Exception as e:  # noqa: BLE001 - a trainer died: restart the group
                text = " ".join(str(e).split())[:300]
                log(f"[controller] {name} failed after {time.monotonic() - t0:.1f}s: {text}")
                self.failures.append({"replica": rid, "attempt": attempt, "error": text})
                if self.lighthouse_failed.is_set():
                    raise RuntimeError("the lighthouse died") from e
                if attempt >= self.args.max_restarts:
                    raise RuntimeError(f"replica {rid} failed {attempt + 1} times") from e
                attempt += 1
            finally:
                await self.stop_mesh(name)
            log(f"[controller] restarting replica {rid} on a new proc mesh (attempt {attempt})")

    async def run(self) -> Dict[str, Any]:
        t0 = time.monotonic()
        try:
            lighthouse = await self.start_lighthouse()
            tasks = [
                asyncio.create_task(self.run_replica(rid, lighthouse))
                for rid in range(self.args.replica_count)
            ]
            everything = asyncio.gather(*tasks)
            lighthouse_lost = asyncio.create_task(self.lighthouse_failed.wait())
            try:
                await asyncio.wait(
                    [everything, lighthouse_lost], return_when=asyncio.FIRST_COMPLETED
                )
                if not everything.done():
                    raise RuntimeError("the lighthouse process died")
                results = everything.result()
            finally:
                lighthouse_lost.cancel()
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            try:
                await asyncio.wait_for(self.lighthouse.stop_lighthouse.call_one(), timeout=10)
            except Exception as e:  # noqa: BLE001
                log(f"[controller] stopping the lighthouse: {type(e).__name__}: {e}")
        finally:
            for name in list(self.meshes):
                await self.stop_mesh(name)
        reports = [r for group in results for r in group]
        return {"wall_s": round(time.monotonic() - t0, 1), "reports": reports}


def check(args: argparse.Namespace, summary: Dict[str, Any], failures: List[Dict]) -> List[str]:
    """What must hold at the end; returns the problems found."""
    problems = []
    reports = summary["reports"]
    if len(reports) != args.replica_count * args.ranks_per_group:
        problems.append(
            f"{len(reports)} reports, expected {args.replica_count * args.ranks_per_group}"
        )
    hashes = {r["hash"] for r in reports}
    steps = {r["final_step"] for r in reports}
    if len(hashes) != 1:
        problems.append(f"state hashes differ: {sorted(hashes)}")
    if len(steps) != 1:
        problems.append(f"final steps differ: {sorted(steps)}")
    if args.kill_at_step is not None:
        if [f["replica"] for f in failures] != [args.kill_replica]:
            problems.append(f"expected one failure, of replica {args.kill_replica}: {failures}")
        restarted = [r for r in reports if r["replica"] == args.kill_replica]
        if not restarted or any(r["attempt"] < 1 for r in restarted):
            problems.append("the killed replica did not finish on a restarted proc mesh")
        elif not all(any((h["to_step"] or 0) > 0 for h in r["heals"]) for r in restarted):
            problems.append("the restarted replica did not heal from a live peer")
    elif failures:
        problems.append(f"unexpected failures: {failures}")
    return problems


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replica-count", type=int, default=2)
    p.add_argument("--ranks-per-group", type=int, default=2, help="trainer processes per group")
    p.add_argument("--steps", type=int, default=100, help="committed steps to train")
    p.add_argument("--kill-at-step", type=int, default=None, help="inject one failure then")
    p.add_argument("--kill-replica", type=int, default=None, help="default: the last group")
    p.add_argument("--kill-rank", type=int, default=None, help="default: its last rank")
    p.add_argument("--kill-mode", choices=("sigkill", "exit"), default="sigkill")
    p.add_argument("--max-restarts", type=int, default=3, help="per replica group")
    p.add_argument("--min-replicas", type=int, default=1, help="lighthouse and Manager")
    p.add_argument("--lighthouse-bind", default="127.0.0.1:0")
    p.add_argument("--join-timeout-ms", type=int, default=2000)
    p.add_argument("--timeout", type=float, default=5.0, help="ft collective timeout, s")
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--final-wait", type=float, default=90.0, help="wait for every group, s")
    p.add_argument("--exit-linger", type=float, default=1.0)
    p.add_argument("--step-sleep", type=float, default=0.1, help="pad every step (pacing)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--deadline", type=float, default=300.0, help="for the whole run, s")
    p.add_argument("--summary-json", default=None, help="write the summary here")
    args = p.parse_args(argv)
    if args.kill_replica is None:
        args.kill_replica = args.replica_count - 1
    if args.kill_rank is None:
        args.kill_rank = args.ranks_per_group - 1
    if not 0 <= args.kill_replica < args.replica_count:
        p.error("--kill-replica out of range")
    if not 0 <= args.kill_rank < args.ranks_per_group:
        p.error("--kill-rank out of range")
    if args.kill_at_step is not None and not 0 <= args.kill_at_step < args.steps:
        p.error("--kill-at-step must be in [0, --steps)")
    return args


async def amain(args: argparse.Namespace) -> int:
    import monarch.actor

    controller = Controller(args)
    # Monarch's default for a process failure nobody handles is to end this controller.
    monarch.actor.unhandled_fault_hook = controller.on_fault
    try:
        summary = await controller.run()
    except BaseException as e:
        log(f"[controller] FAILED: {type(e).__name__}: {e}")
        raise
    problems = check(args, summary, controller.failures)
    summary.update(failures=controller.failures, problems=problems, ok=not problems)
    log("[controller] summary:")
    for r in sorted(summary["reports"], key=lambda r: (r["replica"], r["rank"])):
        heals = ", ".join(f"to step {h['to_step']}" for h in r["heals"]) or "none"
        log(
            f"  replica {r['replica']} rank {r['rank']} attempt {r['attempt']}: "
            f"final step {r['final_step']}, sha256 {r['hash'][:16]}, heals: {heals}, "
            f"failed steps {r['failed_steps']}, loss {r['loss']}, train {r['train_s']}s"
        )
    log(
        f"[controller] {len(controller.failures)} failure(s); wall {summary['wall_s']}s; "
        + (
            "OK: every rank of every group holds the same state"
            if not problems
            else "PROBLEMS: " + "; ".join(problems)
        )
    )
    print("RESULT " + json.dumps(summary, sort_keys=True), flush=True)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1, sort_keys=True)
    return 0 if not problems else 1


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    _make_ft_importable()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
