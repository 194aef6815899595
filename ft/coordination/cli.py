"""``ft-lighthouse``: run the lighthouse (gRPC quorum service + HTTP dashboard).

Example::

    FT_JOB_SECRET_FILE=/etc/ft/secret ft-lighthouse --min_replicas 2 \
        --join_timeout_ms 60000 --quorum_tick_ms 100 --heartbeat_timeout_ms 5000

By default it listens on this host's advertised address (``FT_ADVERTISE_HOST``, else the
address its name resolves to), port 29510, dashboard on 29511. Beyond loopback it refuses to
start without a job secret unless ``--insecure`` is given (docs/security.md).

Defaults: ``--join_timeout_ms 60000`` (60 s; ``LighthouseServer(...)`` built in Python
defaults to 100 ms, as torchft's), ``--quorum_tick_ms 100``, ``--heartbeat_timeout_ms 5000``.

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
    CLI_DEFAULT_JOIN_TIMEOUT_MS,
    DEFAULT_QUORUM_TICK_MS,
    LighthouseServer,
)
from ..utils import net
from ..utils.auth import SECRET_FILE_ENV, InsecureServerError, resolve_secret

DEFAULT_PORT = 29510


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
    _flag(
        p,
        "bind",
        default=None,
        help="gRPC address to listen on (default: this host's advertised address, port 29510; "
        "'[::]:29510' listens on every interface)",
    )
    _flag(
        p,
        "min_replicas",
        type=int,
        required=True,
        help="fewest replica groups in a quorum (fast path excepted)",
    )
    _flag(
        p,
        "join_timeout_ms",
        type=int,
        default=CLI_DEFAULT_JOIN_TIMEOUT_MS,
        help="how long to wait for heartbeating replicas to join a quorum (the command's "
        "default; LighthouseServer(...) in Python defaults to 100 ms, as torchft's)",
    )
    _flag(
        p,
        "quorum_tick_ms",
        type=int,
        default=DEFAULT_QUORUM_TICK_MS,
        help="period of quorum evaluation and failure detection",
    )
    _flag(
        p,
        "heartbeat_timeout_ms",
        type=int,
        default=DEFAULT_HEARTBEAT_TIMEOUT_MS,
        help="a replica is dead after this long without a heartbeat",
    )
    _flag(
        p,
        "http_bind",
        default=None,
        help="dashboard address (default: gRPC host, gRPC port + 1; '' disables)",
    )
    _flag(
        p,
        "auth_token",
        default=None,
        help="an extra dashboard credential for operators (default: env FT_AUTH_TOKEN); the "
        "job secret is always accepted",
    )
    _flag(
        p,
        "secret_file",
        default=None,
        help="file holding the job secret (default: env FT_JOB_SECRET_FILE, then FT_JOB_SECRET); "
        "with it every call must be signed (docs/security.md)",
    )
    _flag(
        p,
        "insecure",
        action="store_true",
        default=False,
        help="serve beyond loopback without a job secret (anyone who reaches the ports can "
        "join or stop the job); logged as a warning at every start",
    )
    _flag(
        p,
        "dead_grace_ms",
        type=int,
        default=DEFAULT_DEAD_GRACE_MS,
        help="dead replicas leave the dashboard this long after their heartbeat expired",
    )
    _flag(
        p,
        "quorum_id_file",
        default=None,
        help="file persisting the last quorum id (ids never repeat across restarts anyway)",
    )
    _flag(p, "hostname", default=None, help="host name to advertise (default: from --bind)")
    _flag(
        p,
        "transport",
        default=os.environ.get("FT_LIGHTHOUSE_TRANSPORT", "auto"),
        choices=["auto", "native", "grpcio"],
        help="gRPC server: native (C++, when built), grpcio, or auto (native when built)",
    )
    _flag(p, "log_level", default=os.environ.get("FT_LOG_LEVEL", "INFO"), help="logging level")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.bind is None:
        args.bind = _rpc.join_hostport(
            net.bind_host_for(net.advertise_host()).strip("[]"), DEFAULT_PORT
        )
    if args.secret_file:
        os.environ[SECRET_FILE_ENV] = args.secret_file  # read by LighthouseServer, never logged
    http_bind = args.http_bind
    if http_bind is None:
        host, port = _rpc.split_hostport(args.bind)
        http_bind = _rpc.join_hostport(host or "::", port + 1 if port else 0)

    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        logging.getLogger("ft.lighthouse").info(
            "received %s, shutting down", signal.Signals(signum).name
        )
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        secret = resolve_secret()
    except ValueError as e:
        print(f"ft-lighthouse: {e}", file=sys.stderr)
        return 2
    try:
        server = _start(args, http_bind, secret)
    except InsecureServerError as e:
        print(f"ft-lighthouse: {e}", file=sys.stderr)
        return 2
    # One machine-readable line for scripts and tests.
    print(
        f"ft-lighthouse ready grpc={server.address()} dashboard={server.dashboard_address()}",
        flush=True,
    )
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()
    return 0


def _start(args, http_bind: str, secret) -> LighthouseServer:
    return LighthouseServer(
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
        secret=secret,
        insecure=args.insecure or None,
    )


if __name__ == "__main__":
    sys.exit(main())
