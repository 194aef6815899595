"""A whole job with the job secret and TLS on every path: a real lighthouse, two replica groups
in their own processes, signed gRPC over TLS, and a heal over HTTPS whose metadata and ranges
are signed. The groups start with different weights (init_sync), so ending bitwise identical
proves the heal went through every secure path; a client without TLS cannot even talk to the
lighthouse."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ft.coordination import LighthouseClient
from ft.utils.tls import TLSConfig
from tests.manager.test_default_configs import assert_bitwise_equal

SECRET = "secure-job-secret-0123456789abcdef"


@pytest.mark.parametrize("use_tls", [False, True], ids=["secret", "secret+tls"])
def test_full_heal_with_the_job_secret_and_tls(test_pki, use_tls, replicas):
    tls = TLSConfig(cert_file=test_pki["cert"], key_file=test_pki["key"], ca_file=test_pki["ca"])
    # HTTP(S) heals: the same-host path (a local socket) would bypass the network path.
    env = {"FT_JOB_SECRET": SECRET, "FT_JOB_SECRET_FILE": "", "FT_CHECKPOINT_SAME_HOST": "0"}
    if use_tls:
        env.update(
            FT_TLS_CERT_FILE=test_pki["cert"],
            FT_TLS_KEY_FILE=test_pki["key"],
            FT_TLS_CA_FILE=test_pki["ca"],
        )
    combo = {"name": "heal", "use_async_quorum": False, "init_sync": True, "min_replica_size": 2}
    # The groups read the lighthouse's address from the store ("lh/0"), once it is set below.
    w = replicas(
        "tests.manager.workers:default_config_combos",
        2,
        env=env,
        lh_addr_kwarg=None,
        lighthouse=dict(
            min_replicas=2,
            join_timeout_ms=500,
            heartbeat_timeout_ms=2000,
            secret=SECRET,
            tls=tls if use_tls else None,
        ),
        combos=[combo],
        target_step=3,
    )
    lh = w.lh
    if use_tls:
        assert lh._server.transport == "grpcio"
        # no TLS, right secret: the handshake fails, nothing is said
        with LighthouseClient(lh.address(), 1.0, secret=SECRET) as plain:
            with pytest.raises((TimeoutError, Exception)):
                plain.heartbeat("plain", timeout=1.0)
        assert "plain" not in lh._state.heartbeats
    w.store.set("lh/0", lh.address())
    w.store.wait(["done/0/0", "done/0/1"], timedelta(seconds=90))
    results = w.join(timeout=60)
    states = [r["heal"] for r in results]
    assert [s["step"] for s in states] == [3, 3], [s["trace"] for s in states]
    assert_bitwise_equal(states, "heal")
