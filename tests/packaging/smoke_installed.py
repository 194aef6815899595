"""Run by the packaging tests with the interpreter of an environment where ft-torch is
installed, from a folder outside the source tree. Prints one JSON line: where ft came from,
what it was built with, and the result of an allreduce on the "ft" backend between two
processes.

    python smoke_installed.py            # the checks (starts the two ranks itself)
    python smoke_installed.py rank R PORT
"""

import importlib.metadata
import json
import socket
import subprocess
import sys
from datetime import timedelta


def rank_main(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    import ft  # noqa: F401  (makes the backend "ft" available)

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("ft", store=store, rank=rank, world_size=2)
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(t.tolist()), flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if sys.argv[1:2] == ["rank"]:
        rank_main(int(sys.argv[2]), int(sys.argv[3]))
        return
    import ft

    out = {"ft_file": ft.__file__, "version": ft.__version__}
    import torch

    from ft import _C
    from ft.coordination import rpc_server
    from ft.coordination.dashboard import page_html

    out.update(
        torch=torch.__version__,
        c_file=_C.__file__,
        has_nccl=bool(_C.has_nccl),
        native_grpc=bool(rpc_server.native_available()),
        dashboard_bytes=len(page_html()),
        requires=importlib.metadata.requires("ft-torch"),
        dist_version=importlib.metadata.version("ft-torch"),
    )
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "rank", str(r), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        if p.returncode != 0:
            raise SystemExit(f"rank exited {p.returncode}:\n{stderr[-3000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    out["allreduce"] = results
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
