"""Child-process entry point for the coordination tests.

``ft.coordination`` imports neither torch nor the C++ extension, so child processes start in
a fraction of a second and these tests do not depend on the backend build. Started by
``tests.coordination._helpers.CoordinationChild`` (the ``children`` fixture) as
``python -m tests.coordination._child MODE ...`` in the repository root. Modes:

    manager REPLICA_ID LIGHTHOUSE_ADDR WORLD_SIZE [HEARTBEAT_S [TRANSPORT]]
    lighthouse [LighthouseServer kwargs as JSON]
    cli [ft-lighthouse flags...]
    subscriber REPLICA_ID LIGHTHOUSE_ADDR
    exit-mid-call LIGHTHOUSE_ADDR CLIENT_TRANSPORT
    drop-streaming-clients LIGHTHOUSE_ADDR ROUNDS

A mode with the suffix ``-without-torch`` (``cli-without-torch``) runs with torch and ``ft._C``
hidden: importing either raises ModuleNotFoundError, as on a host where they are not installed.
"""

import json
import signal
import sys
import threading


class _Hidden:
    """A meta path finder that makes the named top-level modules impossible to import."""

    NAMES = ("torch", "ft._C")

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.NAMES or fullname.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"{fullname} is hidden from this process", name=fullname)
        return None


def _serve_forever(server) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    server.shutdown()


def main() -> int:
    mode = sys.argv[1]
    if mode.endswith("-without-torch"):
        mode = mode[: -len("-without-torch")]
        sys.meta_path.insert(0, _Hidden())
    if mode != "cli":
        import logging

        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s: %(message)s")
    import ft.coordination as coord

    if mode == "manager":
        replica_id, lighthouse, world_size = sys.argv[2], sys.argv[3], int(sys.argv[4])
        hb = float(sys.argv[5]) if len(sys.argv) > 5 else 0.05
        server = coord.ManagerServer(
            replica_id,
            lighthouse,
            "127.0.0.1",
            "127.0.0.1:0",
            f"store-{replica_id}",
            world_size,
            hb,
            5.0,
            transport=sys.argv[6] if len(sys.argv) > 6 else "auto",
        )
        print(f"ADDRESS {server.address()}", flush=True)
        _serve_forever(server)
    elif mode == "lighthouse":
        kwargs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
        server = coord.LighthouseServer(**kwargs)
        print(f"ADDRESS {server.address()} {server.dashboard_address()}", flush=True)
        _serve_forever(server)
    elif mode == "subscriber":
        # A replica's process as the lighthouse sees it: heartbeats, a failure subscription
        # named "{replica}/0" (as ft.Manager subscribes), and one quorum request.
        replica_id, lighthouse = sys.argv[2], sys.argv[3]
        client = coord.LighthouseClient(lighthouse, 5.0)
        sub = client.subscribe_failures(lambda n: None, subscriber=f"{replica_id}/0")
        assert sub.wait_subscribed(10)
        client.heartbeat(replica_id, timeout=5.0)
        print("ADDRESS subscribed", flush=True)
        client.quorum(replica_id, timeout=30.0)
        print("QUORUM", flush=True)
        while True:
            client.heartbeat(replica_id, timeout=5.0)
            threading.Event().wait(0.05)
    elif mode == "exit-mid-call":
        # Returns (the interpreter exits) while daemon threads wait in Quorum calls.
        lighthouse, transport = sys.argv[2], sys.argv[3]
        client = coord.LighthouseClient(lighthouse, 5.0, transport=transport)
        client.heartbeat("exit", timeout=5.0)
        for i in range(8):
            threading.Thread(
                target=lambda i=i: client.quorum(f"exit-{i}", timeout=30.0), daemon=True
            ).start()
        threading.Event().wait(0.5)
        print("EXITING", flush=True)
    elif mode == "drop-streaming-clients":
        # Native clients whose heartbeat streams are still open when they are dropped, in a
        # process with no gRPC server of its own: each stream's call ends on gRPC's callback
        # thread after its client is gone (csrc/grpc_server/grpc_client.cpp, ChannelReleaser).
        import gc

        lighthouse, rounds = sys.argv[2], int(sys.argv[3])
        for r in range(rounds):
            clients = [coord.LighthouseClient(lighthouse, 5.0) for _ in range(16)]
            for i, client in enumerate(clients):
                client.heartbeat(f"drop-{r}-{i}", timeout=5.0)
            assert all(c._heartbeats.sent == 1 for c in clients), "heartbeats went unary"
            del clients, client
            gc.collect()
        print("DROPPED", flush=True)
    elif mode == "cli":
        from ft.coordination.cli import main as cli_main

        return cli_main(sys.argv[2:])
    else:
        raise SystemExit(f"unknown mode {mode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
