"""A fast stand-in for a training script (no torch, no ft import): speaks the ft-launch protocol.

Groups share their step through files in FT_LAUNCH_LOG_DIR; a restarted group "heals" to the
highest step it finds there. Options: --crash (exit 1 at once), --stubborn (ignore the stop file
and SIGTERM), --dump-env (write the environment to a JSON file), --step-s (seconds per step).
"""

import argparse
import glob
import json
import os
import signal
import sys
import threading
import time

PREFIX = "@ft-progress "


def emit(event, **fields):
    rec = {
        "event": event,
        "group": int(os.environ["REPLICA_GROUP_ID"]),
        "rank": int(os.environ["RANK"]),
        "time": time.time(),
    }
    rec.update(fields)
    sys.stdout.write(PREFIX + json.dumps(rec) + "\n")
    sys.stdout.flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--crash", action="store_true")
    p.add_argument("--stubborn", action="store_true")
    p.add_argument("--dump-env", action="store_true")
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument(
        "--persistent-fault-group",
        type=int,
        default=None,
        help="this group's steps all fail with one error; it gives up after 5 (exit 78)",
    )
    a = p.parse_args()
    gid, rank = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["RANK"])
    ngroups = int(os.environ["NUM_REPLICA_GROUPS"])
    log_dir = os.environ["FT_LAUNCH_LOG_DIR"]
    attempt = int(os.environ["FT_LAUNCH_ATTEMPT"])
    max_steps = int(os.environ.get("FT_MAX_STEPS", "1000000"))
    parent = int(os.environ["FT_LAUNCH_PARENT_PID"])

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()
    if a.dump_env:
        keys = [
            "MASTER_ADDR",
            "MASTER_PORT",
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "REPLICA_GROUP_ID",
            "NUM_REPLICA_GROUPS",
            "TORCHFT_LIGHTHOUSE",
            "TORCHELASTIC_RESTART_COUNT",
            "OMP_NUM_THREADS",
            "FT_LAUNCH_STOP_FILE",
            "CUDA_VISIBLE_DEVICES",
        ]
        with open(os.path.join(log_dir, f"env_g{gid}_r{rank}_t{attempt}.json"), "w") as f:
            json.dump({k: os.environ.get(k) for k in keys}, f)
    if a.crash:
        print("fake worker: crashing on purpose", file=sys.stderr)
        sys.exit(1)
    if a.stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    injected = []
    signal.signal(signal.SIGUSR1, lambda *_: injected.append(1))
    emit("start", attempt=attempt)

    def steps():
        out = {}
        for path in glob.glob(os.path.join(log_dir, "fake_step_g*")):
            try:
                out[path] = int(open(path).read() or 0)
            except (OSError, ValueError):
                pass
        return out

    my_file = os.path.join(log_dir, f"fake_step_g{gid}")
    step = 0
    quorum = attempt
    if attempt > 1:
        others = [v for k, v in steps().items() if k != my_file]
        if others:
            emit("heal", from_step=0, to_step=max(others))
            step = max(others)
    stop_file = os.environ["FT_LAUNCH_STOP_FILE"]
    final_since = None
    failures = 0
    while True:
        if rank == 0:
            with open(my_file + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(my_file + ".tmp", my_file)
        stop = os.path.exists(stop_file) and not a.stubborn
        if step >= max_steps or stop:
            if final_since is None:
                final_since = time.time()
                emit("final", step=step)
            everyone = len([v for v in steps().values() if v >= step]) >= ngroups
            if stop:
                # Like the real example's stop agreement: once every group has
                # stopped stepping (each sees the stop file within a step), all
                # settle on the highest step any of them reached.
                time.sleep(max(0.3, 6 * a.step_s))
                step = max([step] + list(steps().values()))
                break
            if everyone or time.time() - final_since > 20:
                break
            time.sleep(a.step_s)
            continue
        time.sleep(a.step_s)
        if a.persistent_fault_group == gid:
            failures += 1
            error = "allreduce: ValueError: ft: NCCL lane 0: ranks 0 and 1 are on one GPU"
            emit(
                "step",
                step=step,
                participants=ngroups,
                quorum_id=quorum,
                committed=False,
                error=error,
            )
            if failures >= 5:
                emit("gave_up", error=f"5 consecutive steps failed: {error}")
                sys.exit(78)
            continue
        ok = not injected
        injected.clear()
        if ok:
            step += 1
        emit(
            "step",
            step=step,
            loss=1.0 / (1 + step),
            participants=ngroups,
            quorum_id=quorum,
            committed=ok,
            injected=not ok,
        )
    emit("done", step=step, hash=f"fake-{step}", accuracy=0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
