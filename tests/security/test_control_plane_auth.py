"""Attacks on the control plane (lighthouse and ManagerServer gRPC), each as a test that must
fail to do harm. Real servers on loopback stand in for hosts; the attacker is a plain client
that knows the address and not the job secret (or a wrong one), or that replays a request it
captured. Each test asserts what the victim keeps: its process, its membership, its vote.

Every test also checks that the same request made with the job secret works, so a server that
refused everything would fail it."""

from __future__ import annotations

import logging
import os
import threading
import time

import grpc
import pytest

from ft.coordination import CoordinationError, LighthouseClient, ManagerClient
from ft.coordination._proto import torchft_pb2 as pb
from ft.utils.auth import (
    GRPC_PURPOSE,
    InsecureServerError,
    JobSecret,
    Signer,
)

SECRET = "job-secret-for-tests-0123456789abcdef"
WRONG = "a-different-secret-0123456789abcdef"


def refused(exc: BaseException) -> bool:
    return isinstance(exc, CoordinationError) and exc.code == grpc.StatusCode.UNAUTHENTICATED


def attacker_quorum(addr: str, secret, replica_id: str = "attacker", step: int = 10**12):
    with LighthouseClient(addr, 2.0, secret=secret) as c:
        return c.quorum(
            replica_id,
            timeout=2.0,
            address="http://198.51.100.66:1",
            store_address="198.51.100.66:1",
            step=step,
            world_size=1,
            retries=0,
        )


@pytest.mark.parametrize("attacker_secret", [None, WRONG], ids=["no-secret", "wrong-secret"])
def test_forged_quorum_with_a_huge_step_cannot_take_over_healing(
    lighthouse_factory, attacker_secret, monkeypatch
):
    monkeypatch.delenv("FT_JOB_SECRET", raising=False)
    lh = lighthouse_factory(min_replicas=2, secret=SECRET)
    results = {}

    def member(rid: str, step: int) -> None:
        with LighthouseClient(lh.address(), 5.0, secret=SECRET) as c:
            results[rid] = c.quorum(
                rid,
                timeout=10.0,
                address=f"http://127.0.0.1:{step + 1}",
                store_address="127.0.0.1:1",
                step=step,
                world_size=1,
            )

    with pytest.raises(CoordinationError) as e:
        attacker_quorum(lh.address(), attacker_secret)
    assert refused(e.value), e.value
    assert "job secret" in str(e.value)
    threads = [threading.Thread(target=member, args=(rid, s)) for rid, s in (("a", 3), ("b", 5))]
    for t in threads:
        t.start()
    # the attacker keeps trying while the real quorum forms
    for _ in range(5):
        with pytest.raises(CoordinationError):
            attacker_quorum(lh.address(), attacker_secret)
    for t in threads:
        t.join(15)
    q = results["a"]
    ids = sorted(m.replica_id for m in q.participants)
    assert ids == ["a", "b"]
    assert max(m.step for m in q.participants) == 5  # nobody claims 10**12
    assert all("198.51.100.66" not in m.address for m in q.participants)
    status = lh._state.status()
    assert "attacker" not in str(status)


def test_replayed_request_is_refused(lighthouse_factory):
    lh = lighthouse_factory(secret=SECRET)
    target = lh.address().replace("http://", "")
    path = "/torchft.LighthouseService/Heartbeat"
    body = pb.LighthouseHeartbeatRequest(replica_id="r").SerializeToString()
    signed = Signer(JobSecret(SECRET), GRPC_PURPOSE).sign_request(path, body, lh.server_id)
    head = signed[: len(signed) - len(body)]  # the leading auth field alone
    with grpc.insecure_channel(target) as ch:
        call = ch.unary_unary(path, request_serializer=None, response_deserializer=None)
        call(signed, timeout=5.0)  # the genuine request
        with pytest.raises(grpc.RpcError) as e:
            call(signed, timeout=5.0)  # the replay
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "replayed" in e.value.details()
        # a signature moved onto another request (another replica id) does not verify either
        other = pb.LighthouseHeartbeatRequest(replica_id="someone-else").SerializeToString()
        with pytest.raises(grpc.RpcError) as e:
            call(head + other, timeout=5.0)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "bad signature" in e.value.details()
    assert "someone-else" not in lh._state.heartbeats


def test_made_up_heartbeat_ids_are_refused_and_do_not_block_quorums(lighthouse_factory):
    lh = lighthouse_factory(min_replicas=1, secret=SECRET)
    with LighthouseClient(lh.address(), 2.0) as attacker:
        for i in range(20):
            with pytest.raises(CoordinationError) as e:
                attacker.heartbeat(f"ghost-{i}", timeout=2.0)
            assert refused(e.value)
    assert not any(r.startswith("ghost") for r in lh._state.heartbeats)
    with LighthouseClient(lh.address(), 2.0, secret=SECRET) as c:
        c.heartbeat("real", timeout=2.0)
        q = c.quorum("real", timeout=5.0, step=1, world_size=1)
    assert [m.replica_id for m in q.participants] == ["real"]


def test_forged_subscribe_failures_cancel_does_not_declare_a_live_replica_dead(lighthouse_factory):
    lh = lighthouse_factory(min_replicas=1, secret=SECRET, heartbeat_timeout_ms=5000)
    seen = []
    with (
        LighthouseClient(lh.address(), 2.0, secret=SECRET) as member,
        LighthouseClient(lh.address(), 2.0, secret=SECRET) as watcher,
    ):
        sub = watcher.subscribe_failures(seen.append, subscriber="watcher/0")
        assert sub.wait_subscribed(5)
        member.heartbeat("A", timeout=2.0)
        member.quorum("A", timeout=5.0, step=1, world_size=1)
        with LighthouseClient(lh.address(), 2.0) as attacker:
            # the attack: open the victim's own subscription and drop it at once
            with pytest.raises(CoordinationError) as e:
                for _ in attacker.failures(timeout=1.0, subscriber="A/0"):
                    pass
            assert refused(e.value)
        time.sleep(0.5)  # several ticks: a death would have been announced by now
        sub.close()
    assert not [n for n in seen if n.replica_id == "A"], seen
    assert "A" in lh._state.heartbeats


def _manager_env() -> dict:
    env = dict(os.environ)
    env["FT_JOB_SECRET"] = SECRET
    env.pop("FT_JOB_SECRET_FILE", None)
    return env


def test_forged_kill_without_the_secret_leaves_the_group_running(children):
    lh = children(
        "lighthouse",
        '{"bind": "127.0.0.1:0", "min_replicas": 1, "http_bind": ""}',
        env=_manager_env(),
    )
    lh_addr = lh.address()
    group = children("manager", "victim", lh_addr, "1", env=_manager_env())
    addr = group.address()
    for secret in (None, WRONG):
        with ManagerClient(addr, 2.0, secret=secret) as attacker:
            with pytest.raises(CoordinationError) as e:
                attacker.kill("pwned", timeout=2.0)
            assert refused(e.value)
    time.sleep(0.3)
    assert group.proc.poll() is None, group.output()
    # the job's own kill (the dashboard's path) still works: the refusal above was the secret
    with ManagerClient(addr, 2.0, secret=SECRET) as operator:
        try:
            operator.kill("stopped by the operator", timeout=2.0)
        except (CoordinationError, TimeoutError):
            pass  # the process may exit before it answers
    assert group.wait(10) != 0


def test_forged_should_commit_is_not_counted_as_a_vote(lighthouse_factory, manager_factory):
    lh = lighthouse_factory(min_replicas=1, secret=SECRET)
    ms = manager_factory("g", lh.address(), world_size=2, secret=SECRET)
    with (
        ManagerClient(ms.address(), 2.0, secret=SECRET) as rank0,
        ManagerClient(ms.address(), 2.0, secret=SECRET) as rank1,
        ManagerClient(ms.address(), 2.0) as attacker,
    ):
        # the attack: vote "no" (or "yes") for rank 1 before rank 1 does
        for vote in (False, True):
            with pytest.raises(CoordinationError) as e:
                attacker.should_commit(1, 0, vote, timeout=2.0)
            assert refused(e.value)
        answers = {}

        def vote(client, rank):
            answers[rank] = client.should_commit(rank, 0, True, timeout=5.0)

        threads = [threading.Thread(target=vote, args=(c, r)) for c, r in ((rank0, 0), (rank1, 1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert answers == {0: True, 1: True}


def test_forged_manager_quorum_cannot_replace_the_checkpoint_address(
    lighthouse_factory, manager_factory
):
    lh = lighthouse_factory(min_replicas=1, secret=SECRET)
    ms = manager_factory("g", lh.address(), world_size=1, secret=SECRET)
    with ManagerClient(ms.address(), 2.0) as attacker:
        with pytest.raises(CoordinationError) as e:
            attacker._quorum(0, 10**12, "http://198.51.100.66:1", False, timeout=2.0)
        assert refused(e.value)
        with pytest.raises(CoordinationError) as e:
            attacker._checkpoint_metadata(0, timeout=2.0)
        assert refused(e.value)
    with ManagerClient(ms.address(), 2.0, secret=SECRET) as rank0:
        r = rank0._quorum(0, 1, "http://127.0.0.1:9", False, timeout=10.0)
        assert r.max_step == 1
        assert rank0._checkpoint_metadata(0, timeout=2.0) == "http://127.0.0.1:9"


def test_servers_refuse_to_listen_beyond_loopback_without_a_secret(monkeypatch, caplog):
    from ft.coordination import LighthouseServer

    for name in ("FT_JOB_SECRET", "FT_JOB_SECRET_FILE", "FT_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InsecureServerError, match="without a job secret"):
        LighthouseServer("[::]:0", 1, http_bind="", transport="grpcio")
    # insecure mode starts, and says at every start what it gives up
    with caplog.at_level(logging.WARNING, logger="ft.auth"):
        lh = LighthouseServer("[::]:0", 1, http_bind="", transport="grpcio", insecure=True)
        lh.shutdown(grace=0)
    assert any("WITHOUT AUTHENTICATION" in r.getMessage() for r in caplog.records)
    # loopback needs nothing
    LighthouseServer("127.0.0.1:0", 1, http_bind="", transport="grpcio").shutdown(grace=0)


def test_the_secret_is_never_logged_or_shown(lighthouse_factory, manager_factory, caplog, tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    with caplog.at_level(logging.DEBUG):
        from ft.utils.auth import resolve_secret

        os.environ["FT_JOB_SECRET_FILE"] = str(path)
        try:
            secret = resolve_secret()
            lh = lighthouse_factory(min_replicas=1)
            ms = manager_factory("g", lh.address())
            with ManagerClient(ms.address(), 2.0) as c:
                c._quorum(0, 1, "", False, timeout=10.0)
            with ManagerClient(ms.address(), 2.0, secret=WRONG) as bad:
                with pytest.raises(CoordinationError) as e:
                    bad._quorum(0, 1, "", False, timeout=2.0)
        finally:
            del os.environ["FT_JOB_SECRET_FILE"]
    assert SECRET not in repr(secret) and SECRET not in str(secret)
    assert SECRET not in str(e.value) and WRONG not in str(e.value)
    assert not [r for r in caplog.records if SECRET in r.getMessage() or WRONG in r.getMessage()]
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(secret)
