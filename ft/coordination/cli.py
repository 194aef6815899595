"""``ft-lighthouse``: run the lighthouse (gRPC quorum service + HTTP dashboard).

Example::

    ft-lighthouse --bind [::]:29510 --min_replicas 2 --join_timeout_ms 60000 \
        --quorum_tick_ms 100 --heartbeat_timeout_ms 5000

Every flag is accepted in underscore and dash spelling (``--min_replicas`` / ``--min-replicas``).
SIGTERM and SIGINT shut the server down cleanly (exit status 0).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Optional, Sequence

from . import _rpc
from .lighthouse import (
    DEFAULT_DEAD_GRACE_MS,
    DEFAULT_HEARTBEAT_TIMEOUT_MS,
    DEFAULT_JOIN_TIMEOUT_MS,
    DEFAULT_QUORUM_TICK_MS,
    LighthouseServer,
)


def _flag(parser: argparse.ArgumentParser, name: str, **kw) -> None:
    names = [f"--{name}"]
    if "_" in name:
        names.append(f"--{name.replace('_', '-')}")
    parser.add_argument(*names, dest=name, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ft-lighthouse",
        description="ft lighthouse: decides which replica groups form each step's quorum.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _flag(p, "bind", default="[::]:29510", help="gRPC address to listen on")
    _flag(p, "min_replicas", type=int, required=True,
          help="fewest replica groups in a quorum (fast path excepted)")
    _flag(p, "join_timeout_ms", type=int, default=DEFAULT_JOIN_TIMEOUT_MS,
          help="how long to wait for heartbeating replicas to join a quorum")
    _flag(p, "quorum_tick_ms", type=int, default=DEFAULT_QUORUM_TICK_MS,
          help="period of quorum evaluation and failure detection")
    _flag(p, "heartbeat_timeout_ms", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT_MS,
          help="a replica is dead after this long without a heartbeat")
    _flag(p, "http_bind", default=None,
          help="dashboard address (default: gRPC host, gRPC port + 1; '' disables)")
    _flag(p, "auth_token", default=None,
          help="token required by mutating dashboard endpoints (default: env FT_AUTH_TOKEN)")
    _flag(p, "dead_grace_ms", type=int, default=DEFAULT_DEAD_GRACE_MS,
          help="dead replicas leave the dashboard this long after their heartbeat expired")
    _flag(p, "quorum_id_file", default=None,
          help="file persisting the last quorum id (ids never repeat across restarts anyway)")
    _flag(p, "hostname", default=None, help="host name to advertise (default: from --bind)")
    _flag(p, "transport", default=os.environ.get("FT_LIGHTHOUSE_TRANSPORT", "auto"),
          choices=["auto", "native", "grpcio"],
          help="gRPC server: native (C++, when built), grpcio, or auto (native when built)")
    _flag(p, "log_level", default=os.environ.get("FT_LOG_LEVEL", "INFO"),
          help="logging level")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    http_bind = args.http_bind
    if http_bind is None:
        host, port = _rpc.split_hostport(args.bind)
        http_bind = _rpc.join_hostport(host or "::", port + 1 if port else 0)

    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        logging.getLogger("ft.lighthouse").info("received %s, shutting down",
                                                signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        http_bind=http_bind,
        auth_token=args.auth_token,
        dead_grace_ms=args.dead_grace_ms,
        quorum_id_file=args.quorum_id_file,
        hostname=args.hostname,
        transport=args.transport,
    )
    # One machine-readable line for scripts and tests.
    print(f"ft-lighthouse ready grpc={server.address()} dashboard={server.dashboard_address()}",
          flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
