"""The group's store (torch's TCPStore) authenticates no one: a peer that reaches its port can
write ``manager_addr`` (where the group's ranks send their votes and quorum requests) and
``replica_id``. With the job secret, rank 0 signs what it writes there for this store and this
attempt (ft.utils.auth.StoreValues), and the other ranks refuse a value that is unsigned,
altered, signed with another secret, or copied from another group's store: the Manager fails
to start with an error that says so, and dials nothing. Real stores, a real lighthouse, real
Managers on loopback."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from ft.utils.net import join_hostport
from ft.manager import LIGHTHOUSE_ADDR_KEY, MANAGER_ADDR_KEY, REPLICA_ID_KEY
from ft.utils.auth import AuthError, JobSecret, StoreValues
from tests.coordination._helpers import free_port
from tests.manager.inproc import in_threads, make_manager

SECRET = "store-auth-secret-0123456789abcdef"


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("FT_JOB_SECRET", SECRET)
    monkeypatch.delenv("FT_JOB_SECRET_FILE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)


@pytest.fixture
def lh():
    from ft.coordination import LighthouseServer

    server = LighthouseServer("127.0.0.1:0", 1, http_bind="", secret=SECRET)
    yield server
    server.shutdown(grace=0.1)


@pytest.fixture
def store():
    """The group's store as rank 0 would host it; the attacker writes to it without a secret."""
    s = dist.TCPStore(
        "127.0.0.1",
        free_port(),
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=10),
    )
    yield s
    del s


def _rank1(lh_addr, store):
    """Group rank 1 of a 2-rank group whose rank 0 published to ``store``: its Manager must
    refuse to start (returns the error)."""
    with pytest.raises(AuthError) as e:
        make_manager(
            lh_addr, "g", rank=1, world_size=2, store_port=store.port, timeout=timedelta(seconds=5)
        )
    return str(e.value)


def test_a_forged_manager_addr_is_refused(secret_env, store, lh):
    # The attacker's write: its own server as the group's ManagerServer.
    store.set(MANAGER_ADDR_KEY, "http://127.0.0.1:1")
    store.set(REPLICA_ID_KEY, "g:evil")
    why = _rank1(lh.address(), store)
    assert "store key 'manager_addr'" in why and "not signed with the job secret" in why


def test_a_value_copied_from_another_groups_store_is_refused(secret_env, store, lh):
    # Genuine values, signed by group B's rank 0 for B's store, replayed into this store.
    b = StoreValues(JobSecret(SECRET), "127.0.0.1:29500/0")
    store.set(MANAGER_ADDR_KEY, b.seal(MANAGER_ADDR_KEY, "http://127.0.0.1:1"))
    store.set(REPLICA_ID_KEY, b.seal(REPLICA_ID_KEY, "B:uuid"))
    why = _rank1(lh.address(), store)
    assert "signed for store '127.0.0.1:29500/0'" in why, why
    # ... and an altered one, or one signed with another secret
    here = f"{join_hostport('127.0.0.1', store.port)}/0"
    sealed = StoreValues(JobSecret(SECRET), here).seal(MANAGER_ADDR_KEY, "http://127.0.0.1:1")
    store.set(MANAGER_ADDR_KEY, sealed.replace(b":1", b":2"))
    assert "bad signature" in _rank1(lh.address(), store)
    other = StoreValues(JobSecret("another-secret-0123456789abcdef"), here)
    store.set(MANAGER_ADDR_KEY, other.seal(MANAGER_ADDR_KEY, "http://127.0.0.1:1"))
    assert "bad signature" in _rank1(lh.address(), store)


def test_a_group_with_the_secret_signs_and_reads_its_store(secret_env, lh):
    port = free_port()
    outs = in_threads(
        [
            lambda: make_manager(lh.address(), "g", rank=0, world_size=2, store_port=port),
            lambda: make_manager(lh.address(), "g", rank=1, world_size=2, store_port=port),
        ]
    )
    assert all("value" in o for o in outs), outs
    ms = [o["value"] for o in outs]
    try:
        raw = ms[0]._store.get(MANAGER_ADDR_KEY)
        assert raw.startswith(b"ft-signed-v1\n") and raw.endswith(ms[0]._manager.address().encode())
        assert ms[0]._store.get(LIGHTHOUSE_ADDR_KEY).startswith(b"ft-signed-v1\n")
        assert ms[1]._replica_id == ms[0]._replica_id
        # rank 1 signs for the ManagerServer it read from the store, which proves the replica id
        # it read there
        assert ms[1]._client._learn_server_id(5.0) == ms[0]._manager.server_id
    finally:
        in_threads([lambda m=m: m.shutdown(wait=False) for m in ms])
