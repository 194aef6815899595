"""The dashboard's credential: the job secret never travels. An operator signs in with a
one-time login ticket made from the secret (``python -m ft.utils.dashboard_login``), and the
dashboard answers with a session cookie; whoever captures that exchange holds nothing that
signs a gRPC call, a checkpoint request or a store value. With TLS the dashboard serves HTTPS;
without it, a job with a secret warns once per process that its traffic travels in clear.

Everything runs on loopback with ephemeral ports; child processes are killed by their own id
and reaped even when a test fails; every wait has a deadline.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import grpc
import pytest

from ft.coordination import CoordinationError, ManagerClient
from ft.coordination._proto import torchft_pb2 as pb
from ft.utils.auth import (
    CHECKPOINT_CONTENT_PURPOSE,
    CHECKPOINT_REQUEST_PURPOSE,
    GRPC_PURPOSE,
    HTTP_SCHEME,
    SAME_HOST_PURPOSE,
    SERVER_ID_METHOD,
    STORE_PURPOSE,
    AuthError,
    JobSecret,
    Signer,
    StoreValues,
    _mac,
)
from ft.utils.dashboard_login import (
    DASHBOARD_LOGIN_PURPOSE,
    LOGIN_TICKET_TTL_S,
    SESSION_COOKIE,
    SESSION_TTL_S,
    DashboardSessions,
    login_ticket,
)
from ft.utils.tls import TLSConfig
from tests.procs import REPO, child_env, wait_for
from tests.security._recording_proxy import RecordingProxy
from tests.security.test_dashboard_http import (
    ACTION,
    MANAGER_ADDR,
    _form_quorum,
    count_kills,
    lighthouse,
)

SECRET = JobSecret("dashboard-login-test-secret-0123456789")
WRONG = JobSecret("another-jobs-secret-0123456789abcdef")
MS = "/torchft.ManagerService/"
LH = "/torchft.LighthouseService/"
TICKET_RE = re.compile(rb"v1\.\d{10,18}\.[0-9a-f]{32}\.[0-9a-f]{64}")
COOKIE_RE = re.compile(rb"s1\.\d{10,12}\.[0-9a-f]{32}\.[0-9a-f]{64}")


def call(
    base: str,
    path: str,
    body: Optional[dict] = None,
    headers: Optional[Dict[str, str]] = None,
    context: Optional[ssl.SSLContext] = None,
) -> Tuple[int, http.client.HTTPMessage, dict]:
    """GET (or, with ``body``, POST as JSON with the page's action header) ``base + path``."""
    data = json.dumps(body).encode() if body is not None else None
    hdrs = {**(ACTION if data is not None else {}), **(headers or {})}
    req = urllib.request.Request(base + path, data=data, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=5, context=context) as r:
            return r.status, r.headers, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers, json.loads(e.read() or b"{}")


def sign_in(base: str, credential: str, context: Optional[ssl.SSLContext] = None) -> str:
    """The session cookie's value that /api/login gives for ``credential``."""
    code, headers, out = call(base, "/api/login", {"credential": credential}, context=context)
    assert code == 200 and out["signed_in"] is True, (code, out)
    m = re.match(rf"{SESSION_COOKIE}=([^;]+)", headers["Set-Cookie"])
    assert m, headers["Set-Cookie"]
    return m.group(1)


def with_session(cookie: str) -> Dict[str, str]:
    return {"Cookie": f"{SESSION_COOKIE}={cookie}"}


class KeyAsSecret(JobSecret):
    """A 'secret' whose key for every purpose is ``raw``: what an attacker who treats a
    captured value as a signing key has."""

    __slots__ = ("_raw",)

    def __init__(self, raw: bytes) -> None:
        super().__init__("x" * 32, source="captured")
        self._raw = raw

    def key(self, purpose: str) -> bytes:
        return self._raw


def unary(addr: str, method: str, data: bytes) -> Optional[grpc.RpcError]:
    """Sends raw ``data`` as a call of ``method``; its refusal, or None if it was answered."""
    with grpc.insecure_channel(addr.replace("http://", "")) as ch:
        try:
            ch.unary_unary(method, request_serializer=None, response_deserializer=None)(
                data, timeout=5.0
            )
        except grpc.RpcError as e:
            return e
    return None


def server_id(addr: str) -> str:
    """A server's id, asked without checking its proof (as an attacker would)."""
    with grpc.insecure_channel(addr.replace("http://", "")) as ch:
        answer = ch.unary_unary(SERVER_ID_METHOD, None, None)(b"0" * 32, timeout=5.0)
    return json.loads(answer)["id"]


def with_token(token: str, body: bytes) -> bytes:
    from ft.utils.auth import _AUTH_TAG, _varint

    return _AUTH_TAG + _varint(len(token)) + token.encode() + body


@pytest.fixture
def clean_env(monkeypatch):
    """No credential or TLS setting from the environment: each test configures its own."""
    for k in list(os.environ):
        if k.startswith(("FT_JOB_SECRET", "FT_AUTH_TOKEN", "FT_INSECURE", "FT_TLS_")):
            monkeypatch.delenv(k)
    return monkeypatch


def _secret_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FT_")}
    env["FT_JOB_SECRET"] = SECRET.export()
    return env


# --- the secret is not a credential; tickets and sessions are ----------------------------


def test_the_job_secret_itself_is_refused_by_the_dashboard(clean_env):
    """A client that still sends the secret (as older ft told it to) is refused: a dashboard
    that took it would invite it onto the network."""
    with lighthouse(secret=SECRET) as lh:
        _form_quorum(lh, SECRET)
        base = lh.dashboard_address()
        body = {"replica_id": "group-0"}
        kills = count_kills(lh)
        for headers in (
            {"Authorization": "Bearer " + SECRET.export()},
            {"X-FT-Token": SECRET.export()},
            with_session(SECRET.export()),
        ):
            code, _, out = call(base, "/api/status", headers=headers)
            assert code == 401 and out["auth_required"] is True, out
            assert MANAGER_ADDR not in json.dumps(out)
            code, _, out = call(base, "/api/kill", body, headers)
            assert code == 401, out
        code, _, out = call(base, "/api/login", {"credential": SECRET.export()})
        assert code == 401 and "login ticket" in out["error"], out
        assert kills == []


def _dashboard_login(base: str, env: Dict[str, str]) -> subprocess.CompletedProcess:
    """The operator's command that prints a login link for the dashboard at ``base``."""
    return subprocess.run(
        [sys.executable, "-m", "ft.utils.dashboard_login", base],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_login_link_signs_in_once_and_sets_a_strict_httponly_session_cookie(clean_env, tmp_path):
    secret_file = tmp_path / "job-secret"
    secret_file.write_text(SECRET.export())
    secret_file.chmod(0o600)
    with lighthouse(secret=SECRET) as lh:
        _form_quorum(lh, SECRET)
        base = lh.dashboard_address()

        # The operator's command prints a login link; the secret stays on its host.
        env = {**child_env(), "FT_JOB_SECRET_FILE": str(secret_file)}
        env.pop("FT_JOB_SECRET", None)
        out = _dashboard_login(base, env)
        assert out.returncode == 0, out.stderr
        link = out.stdout.strip()
        assert link.startswith(base + "/#login=v1."), link
        assert SECRET.export() not in out.stdout + out.stderr
        ticket = link.split("#login=", 1)[1]

        # Without a secret the command says what to set.
        env.pop("FT_JOB_SECRET_FILE")
        out = _dashboard_login(base, env)
        assert out.returncode == 2 and "FT_JOB_SECRET_FILE" in out.stderr, out

        # Signing in is an action: a cross-site page cannot do it for the browser.
        code, _, out = call(base, "/api/login", {"credential": ticket}, {"X-FT-Request": "0"})
        assert code == 403, out

        code, headers, out = call(base, "/api/login", {"credential": ticket})
        assert code == 200, out
        cookie = headers["Set-Cookie"]
        attrs = [a.strip() for a in cookie.split(";")]
        assert attrs[0].startswith(f"{SESSION_COOKIE}=s1.")
        assert "HttpOnly" in attrs and "SameSite=Strict" in attrs and "Path=/" in attrs
        assert f"Max-Age={SESSION_TTL_S}" in attrs and SESSION_TTL_S == 8 * 3600, attrs
        assert "Secure" not in attrs  # plain HTTP: a Secure cookie would never come back
        session = attrs[0].split("=", 1)[1]
        assert SECRET.export() not in cookie

        code, _, st = call(base, "/api/status", headers=with_session(session))
        assert code == 200 and st["quorum"]["members"][0]["address"] == MANAGER_ADDR
        assert st["config"]["auth_required"] is True
        # The session does not stand in for the action header.
        code, _, out = call(
            base,
            "/api/kill",
            {"replica_id": "ghost"},
            {**with_session(session), **ACTION, "X-FT-Request": ""},
        )
        assert code == 403, out
        code, _, out = call(base, "/api/kill", {"replica_id": "ghost"}, with_session(session))
        assert code == 404, out  # authorized; no such group

        # A ticket is good once, from this job's secret, for a few minutes.
        code, _, out = call(base, "/api/login", {"credential": ticket})
        assert code == 401 and "replayed" in out["error"], out
        code, _, out = call(base, "/api/login", {"credential": login_ticket(WRONG)})
        assert code == 401 and "bad signature" in out["error"], out
        ms, nonce = str(int((time.time() - LOGIN_TICKET_TTL_S - 30) * 1000)), "ab" * 16
        mac = _mac(SECRET.key(DASHBOARD_LOGIN_PURPOSE), "ft-dashboard-login", ms, nonce, b"")
        code, _, out = call(base, "/api/login", {"credential": f"v1.{ms}.{nonce}.{mac}"})
        assert code == 401 and "clock" in out["error"], out

        # Sessions: expired, altered, or made with another secret are refused.
        expired = DashboardSessions(SECRET).new_session(ttl_s=-1)
        v, exp, sid, mac = session.split(".")
        altered = f"{v}.{int(exp) + 3600}.{sid}.{mac}"
        foreign = DashboardSessions(WRONG).new_session()
        for bad in (expired, altered, foreign, "", "s1....", "x" * 5000):
            code, _, out = call(base, "/api/status", headers=with_session(bad))
            assert code == 401, (bad[:40], out)

        # Hostile sign-ins get a clear error; the dashboard keeps serving.
        for credential, want in ((123, 400), ("", 400), ("\ud800", 401), ("v1." * 2000, 400)):
            code, _, out = call(base, "/api/login", {"credential": credential})
            assert code == want and out["error"], (credential, out)
        code, _, st = call(base, "/api/status", headers=with_session(session))
        assert code == 200 and st["quorum"]["members"][0]["address"] == MANAGER_ADDR


def test_the_operator_token_signs_in_to_a_session_too(clean_env):
    token = "operator-token-0123456789"
    with lighthouse(auth_token=token) as lh:
        base = lh.dashboard_address()
        code, _, out = call(base, "/api/login", {"credential": "wrong-token"})
        assert code == 401, out
        session = sign_in(base, token)
        code, _, st = call(base, "/api/status", headers=with_session(session))
        assert code == 200 and st["config"]["auth_required"] is True
        # No secret here, so no ticket is worth anything.
        code, _, out = call(base, "/api/login", {"credential": login_ticket(SECRET)})
        assert code == 401, out


# --- what a captured exchange is worth ---------------------------------------------------


def test_nothing_captured_from_a_dashboard_sign_in_can_sign_for_the_job(
    clean_env, children, tmp_path
):
    """An eavesdropper records an operator's whole dashboard session over plain HTTP (sign-in,
    status, an action) and tries every credential-looking value in it, as a job secret and as
    a signing key: against a group's ManagerServer (Kill), the lighthouse (Heartbeat), a
    checkpoint server, and the group's store values. Everything is refused; the group runs."""
    import torch

    from ft.checkpointing import HTTPTransport

    with ExitStack() as stack:
        lh = stack.enter_context(lighthouse(secret=SECRET))
        victim = children("manager", "victim", lh.address(), "1", env=_secret_env())
        victim_addr = victim.address()
        with ManagerClient(victim_addr, 5.0, secret=SECRET, replica_id="victim") as rank0:
            rank0._quorum(0, 0, "", False, 10.0)
        wait_for(
            lambda: any(r["replica_id"] == "victim" for r in lh.status()["replicas"]),
            10,
            "the victim to register",
        )
        port = int(lh.dashboard_address().rsplit(":", 1)[1])
        proxy = RecordingProxy(port)
        stack.callback(proxy.close)
        base = f"http://{proxy.address}"

        # The operator's session, through the eavesdropper.
        session = sign_in(base, login_ticket(SECRET))
        assert call(base, "/api/status", headers=with_session(session))[0] == 200
        assert call(base, "/api/kill", {"replica_id": "ghost"}, with_session(session))[0] == 404
        capture = proxy.transcript()

        # 1. Neither the secret nor any key of the job's purposes crossed the network.
        assert SECRET.export().encode() not in capture
        for purpose in (
            GRPC_PURPOSE,
            CHECKPOINT_REQUEST_PURPOSE,
            CHECKPOINT_CONTENT_PURPOSE,
            SAME_HOST_PURPOSE,
            STORE_PURPOSE,
        ):
            key = SECRET.key(purpose)
            assert key not in capture and key.hex().encode() not in capture, purpose

        # 2. What did cross: the ticket and the session cookie.
        tickets, cookies = set(TICKET_RE.findall(capture)), set(COOKIE_RE.findall(capture))
        assert tickets and cookies, capture[:2000]
        values: List[bytes] = sorted(tickets | cookies)
        keys: List[bytes] = []
        for v in values:
            mac = v.rsplit(b".", 1)[1]
            keys += [v, mac, bytes.fromhex(mac.decode())]
        forged_secrets = [KeyAsSecret(k) for k in keys] + [JobSecret(v) for v in values]

        victim_id, lh_id = server_id(victim_addr), lh.server_id
        kill = pb.KillRequest(msg="pwned").SerializeToString()
        beat = pb.LighthouseHeartbeatRequest(replica_id="attacker").SerializeToString()
        src = stack.enter_context(
            HTTPTransport(
                timedelta(seconds=10),
                1,
                secret=SECRET,
                advertise_host="127.0.0.1",
                bind_host="127.0.0.1",
                same_host=False,
            )
        )
        src.send_checkpoint([1], 7, {"w": torch.ones(4)}, timedelta(seconds=10))
        ckpt_port = int(src.metadata().split("#")[0].rsplit(":", 1)[1])
        ckpt_path = "/ft/v1/checkpoint/7/meta"
        scope = "127.0.0.1:29500/0"

        def fetch(token: str) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", ckpt_port, timeout=5)
            try:
                conn.request("GET", ckpt_path, headers={"Authorization": f"{HTTP_SCHEME} {token}"})
                return conn.getresponse().status
            finally:
                conn.close()

        for forged in forged_secrets:
            # as the key of a Kill bound to the victim's server, and of a heartbeat
            e = unary(
                victim_addr,
                MS + "Kill",
                Signer(forged, GRPC_PURPOSE).sign_request(MS + "Kill", kill, victim_id),
            )
            assert e is not None and e.code() == grpc.StatusCode.UNAUTHENTICATED, e
            assert "bad signature" in e.details(), e.details()
            e = unary(
                lh.address(),
                LH + "Heartbeat",
                Signer(forged, GRPC_PURPOSE).sign_request(LH + "Heartbeat", beat, lh_id),
            )
            assert e is not None and e.code() == grpc.StatusCode.UNAUTHENTICATED, e
            # as the key of a checkpoint request
            what = f"GET 127.0.0.1:{ckpt_port}{ckpt_path}"
            assert fetch(Signer(forged, CHECKPOINT_REQUEST_PURPOSE).sign(what)) == 403
            # as the key of a store value
            sealed = StoreValues(forged, scope).seal("manager_addr", "http://attacker:1")
            with pytest.raises(AuthError):
                StoreValues(SECRET, scope).open("manager_addr", sealed)
        for v in values:  # as the signature itself
            token = v.decode()
            for addr, method, body in (
                (victim_addr, MS + "Kill", kill),
                (lh.address(), LH + "Heartbeat", beat),
            ):
                e = unary(addr, method, with_token(token, body))
                assert e is not None and e.code() == grpc.StatusCode.UNAUTHENTICATED, e
            assert fetch(token) == 403
        # ... and as a job secret in ft's own client: it does not even get to send the Kill.
        for v in values:
            with ManagerClient(victim_addr, 2.0, secret=JobSecret(v)) as attacker:
                with pytest.raises(CoordinationError):
                    attacker.kill("pwned", timeout=2.0)
        assert not any(r["replica_id"] == "attacker" for r in lh.status()["replicas"])
        time.sleep(0.2)
        assert victim.proc.poll() is None, victim.output()

        # The forgeries were well formed: the job's own keys pass the same checks ...
        good = Signer(SECRET, GRPC_PURPOSE).sign_request(LH + "Heartbeat", beat, lh_id)
        assert unary(lh.address(), LH + "Heartbeat", good) is None
        what = f"GET 127.0.0.1:{ckpt_port}{ckpt_path}"
        assert fetch(Signer(SECRET, CHECKPOINT_REQUEST_PURPOSE).sign(what)) == 200
        # ... and the cookie is what it is meant to be: a dashboard session, nothing more.
        code, _, out = call(base, "/api/kill", {"replica_id": "victim"}, with_session(session))
        assert code == 200 and out == {"killed": "victim"}, out
        assert victim.wait(15) == 1


# --- HTTPS ------------------------------------------------------------------------------


def test_with_tls_the_dashboard_serves_https_and_a_secure_cookie(clean_env, test_pki):
    tls = TLSConfig(cert_file=test_pki["cert"], key_file=test_pki["key"], ca_file=test_pki["ca"])
    ctx = ssl.create_default_context(cafile=test_pki["ca"])
    with lighthouse(secret=SECRET, tls=tls) as lh:
        base = lh.dashboard_address()
        assert base.startswith("https://127.0.0.1:"), base
        port = int(base.rsplit(":", 1)[1])
        code, headers, out = call(
            base, "/api/login", {"credential": login_ticket(SECRET)}, context=ctx
        )
        assert code == 200, out
        attrs = [a.strip() for a in headers["Set-Cookie"].split(";")]
        assert {"Secure", "HttpOnly", "SameSite=Strict"} <= set(attrs), attrs
        session = attrs[0].split("=", 1)[1]
        code, _, st = call(base, "/api/status", headers=with_session(session), context=ctx)
        assert code == 200 and st["config"]["auth_required"] is True
        # Plain HTTP gets no answer (no page, no status in clear) ...
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
                conn.request("GET", "/healthz")
                conn.getresponse().read()
        finally:
            conn.close()
        # ... and a client that does not trust the certificate sends nothing.
        with pytest.raises(urllib.error.URLError) as e:
            urllib.request.urlopen(base + "/healthz", timeout=5)
        assert isinstance(e.value.reason, ssl.SSLCertVerificationError), e.value
        with urllib.request.urlopen(base + "/healthz", timeout=5, context=ctx) as r:
            assert r.status == 200  # still serving


# --- the warning -------------------------------------------------------------------------

_CHILD = r"""
import logging, sys
from datetime import timedelta
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
from ft.coordination import LighthouseServer, ManagerServer
from ft.checkpointing import HTTPTransport
lh = LighthouseServer("127.0.0.1:0", 1, http_bind="127.0.0.1:0")
ms = ManagerServer("g", lh.address(), "127.0.0.1", "127.0.0.1:0", "store", 1, 0.1, 5.0)
t = HTTPTransport(timedelta(seconds=5), 1, advertise_host="127.0.0.1", bind_host="127.0.0.1")
lh2 = LighthouseServer("127.0.0.1:0", 1, http_bind="")
print("started", lh.dashboard_address(), flush=True)
for s in (t, ms):
    s.shutdown()
lh.shutdown(grace=0.1)
lh2.shutdown(grace=0.1)
"""


@pytest.mark.parametrize("with_tls", [False, True], ids=["no-tls", "tls"])
def test_a_secret_without_tls_warns_once_per_process_that_traffic_travels_in_clear(
    with_tls, test_pki
):
    env = {k: v for k, v in child_env().items() if not k.startswith("FT_")}
    env["FT_JOB_SECRET"] = SECRET.export()
    if with_tls:
        env.update(
            FT_TLS_CERT_FILE=test_pki["cert"],
            FT_TLS_KEY_FILE=test_pki["key"],
            FT_TLS_CA_FILE=test_pki["ca"],
        )
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "started" in out.stdout, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "travel in clear" in line]
    if with_tls:
        assert warnings == [], out.stderr
        assert "started https://" in out.stdout
    else:
        # Two lighthouses, a ManagerServer and a checkpoint server started: one warning.
        assert len(warnings) == 1, out.stderr
        assert warnings[0].startswith("WARNING ft.tls the lighthouse serves without TLS")
        assert "FT_TLS_CERT_FILE" in warnings[0]
        assert SECRET.export() not in out.stderr
