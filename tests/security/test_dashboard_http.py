"""Attacks on the lighthouse dashboard over HTTP, each test named for the attack and asserting
what the victim keeps: its replica groups, its managers' addresses, its ability to serve.

Everything runs on loopback with ephemeral ports. Child processes (a ManagerServer, headless
Chromium) are killed by their own id and reaped, and sockets closed, even when a test fails;
every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from ft.coordination import LighthouseClient, LighthouseServer, ManagerClient
from ft.utils.auth import JobSecret
from ft.utils.dashboard_login import login_ticket

from tests.coordination._helpers import CoordinationChild
from tests.procs import Proc, wait_for
from tests.security._slow_clients import assert_not_starved, raw_get

CHROMIUM = (
    shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
)

# What the dashboard's own page sends with an action (ft/coordination/dashboard/index.html).
ACTION = {"Content-Type": "application/json", "X-FT-Request": "1"}


# --- helpers -----------------------------------------------------------------------------


def http(
    url: str,
    data: Optional[bytes] = None,
    headers: Optional[Dict[str, str]] = None,
    timeout: float = 5.0,
) -> Tuple[int, str]:
    req = urllib.request.Request(
        url, data=data, headers=headers or {}, method="POST" if data is not None else "GET"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


@pytest.fixture
def clean_env(monkeypatch):
    """No credential from the environment: each test configures its own."""
    for k in ("FT_JOB_SECRET", "FT_JOB_SECRET_FILE", "FT_AUTH_TOKEN", "FT_INSECURE"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@contextmanager
def lighthouse(**kw) -> Iterator[LighthouseServer]:
    kw.setdefault("join_timeout_ms", 200)
    kw.setdefault("quorum_tick_ms", 20)
    kw.setdefault("heartbeat_timeout_ms", 5000)
    kw.setdefault("http_bind", "127.0.0.1:0")
    lh = LighthouseServer("127.0.0.1:0", 1, **kw)
    try:
        yield lh
    finally:
        lh.shutdown(grace=0.1)


def registered_victim(stack: ExitStack, lh: LighthouseServer, replica_id: str) -> CoordinationChild:
    """A real ManagerServer child (Kill makes it exit with status 1, so a kill that got
    through is observable from outside) that the lighthouse knows, address and all, so that
    the dashboard's kill would reach it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FT_")}
    child = CoordinationChild("manager", replica_id, lh.address(), "1", env=env)
    stack.callback(child.kill)
    client = ManagerClient(child.address(), 5.0)
    stack.callback(client.close)
    client._quorum(0, 0, "", False, 10.0)
    wait_for(
        lambda: any(
            r["replica_id"] == replica_id and r["address"] for r in lh.status()["replicas"]
        ),
        10,
        "the victim to register",
    )
    return child


def count_kills(lh: LighthouseServer) -> List[str]:
    """Records every call that reaches the lighthouse's kill path (and still performs it)."""
    calls: List[str] = []
    real = lh._kill

    def kill(replica_id: str, msg: str):
        calls.append(replica_id)
        return real(replica_id, msg)

    lh._kill = kill  # type: ignore[method-assign]
    return calls


# --- CSRF --------------------------------------------------------------------------------

ATTACK_PAGE = """<!doctype html>
<html><head><title>cat pictures</title></head><body>
<iframe name="sink" style="display:none"></iframe>
<form id="form" method="POST" action="DASH/api/kill?replica_id=victim" enctype="text/plain"
      target="sink"><input name='{"replica_id":"victim","pad":"' value='"}'></form>
<script>
"use strict";
const dash = "DASH";
const json = JSON.stringify({replica_id: "victim", msg: "csrf"});
// Every attempt asks the browser to send its cookies for the dashboard (a signed-in
// operator's session cookie is same-site here: another port of the same host).
const c = "include";
const attempts = {
  // "Simple" requests, sent without asking: a no-cors POST of JSON as text/plain ...
  no_cors_json_as_text_plain: () => fetch(dash + "/api/kill",
      {method: "POST", mode: "no-cors", credentials: c, body: json}),
  // ... one with replica_id in the query string and no body at all, and a form body.
  no_cors_query_string: () => fetch(dash + "/api/kill?replica_id=victim",
      {method: "POST", mode: "no-cors", credentials: c}),
  no_cors_form_body: () => fetch(dash + "/api/kill?replica_id=victim", {method: "POST", mode: "no-cors",
      credentials: c, headers: {"Content-Type": "application/x-www-form-urlencoded"}, body: "replica_id=victim"}),
  // no-cors cannot carry a custom header: the browser drops it.
  no_cors_custom_header: () => fetch(dash + "/api/kill", {method: "POST", mode: "no-cors",
      credentials: c, headers: {"X-FT-Request": "1"}, body: json}),
  // With the header, the browser must ask first (CORS preflight); the dashboard never agrees.
  cors_custom_header: () => fetch(dash + "/api/kill", {method: "POST", credentials: c,
      headers: {"X-FT-Request": "1", "Content-Type": "application/json"}, body: json}),
  // Reading the status (the managers' addresses) from another origin.
  cors_read_status: () => fetch(dash + "/api/status", {credentials: c}).then(r => r.text()),
};
(async () => {
  document.getElementById("form").submit();
  const out = {};
  for (const [name, attempt] of Object.entries(attempts)) {
    try {
      const r = await attempt();
      out[name] = typeof r === "string" ? "read:" + r.length : "sent:" + r.type;
    } catch (e) {
      out[name] = "blocked:" + e.name;
    }
  }
  await new Promise(resolve => setTimeout(resolve, 500));  // the form's POST lands meanwhile
  await fetch("/report", {method: "POST", body: JSON.stringify(out)});
})();
</script></body></html>
"""


@contextmanager
def attacker_site(dashboard: str) -> Iterator[Tuple[str, List[dict]]]:
    """The attacker's page on its own loopback port (another origin); yields its URL and the
    reports its script posts back."""
    page = ATTACK_PAGE.replace("DASH", dashboard).encode()
    reports: List[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            code, body = (200, page) if self.path == "/" else (404, b"")
            self.send_response(code)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            reports.append(json.loads(self.rfile.read(n)))
            self.send_response(204)
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", reports
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)


def _exited_unreaped(pid: int) -> bool:
    """True once ``pid`` has exited; leaves it unreaped, so its process group id stays ours."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def headless_chromium(url: str, profile: str, log: str) -> Proc:
    """Chromium loading ``url`` in its own process group; ``kill`` (on the ExitStack) kills
    the whole group and reaps the browser."""
    return Proc(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=20000",
            "--dump-dom",
            url,
        ],
        log_path=log,
        name="chromium",
        process_group=True,
    )


@pytest.mark.skipif(
    not CHROMIUM,
    reason="headless Chromium not installed (apt-get install -y "
    "chromium; scripts/setup.sh does it as root): the CSRF attack needs a real browser",
)
def test_csrf_from_a_page_in_headless_chromium_cannot_kill_a_group(clean_env, tmp_path):
    with ExitStack() as stack:
        lh = stack.enter_context(lighthouse())
        victim = registered_victim(stack, lh, "victim")
        kills = count_kills(lh)
        dashboard = lh.dashboard_address()
        page, reports = stack.enter_context(attacker_site(dashboard))
        browser = stack.enter_context(
            headless_chromium(page, str(tmp_path / "profile"), str(tmp_path / "chromium.log"))
        )
        deadline = time.monotonic() + 60
        while not reports:
            if time.monotonic() > deadline or _exited_unreaped(browser.pid):
                raise AssertionError(
                    "the attacker page never reported back; chromium log:\n"
                    + (tmp_path / "chromium.log").read_text()[-3000:]
                )
            time.sleep(0.05)
        report = reports[0]
        # The page ran, and the browser sent every simple request to the dashboard ...
        for name in (
            "no_cors_json_as_text_plain",
            "no_cors_query_string",
            "no_cors_form_body",
            "no_cors_custom_header",
        ):
            assert report[name] == "sent:opaque", report
        # ... while a request that carries the header, or reads an answer, was stopped.
        assert report["cors_custom_header"].startswith("blocked:"), report
        assert report["cors_read_status"].startswith("blocked:"), report
        time.sleep(0.5)  # anything still in flight (the form's POST) lands

        # What the victim keeps: its group, which the kill path never saw.
        assert kills == []
        assert victim.proc.poll() is None
        assert any(r["replica_id"] == "victim" and r["alive"] for r in lh.status()["replicas"])

        # A plain client outside the browser cannot pass for the page either.
        body = json.dumps({"replica_id": "victim"}).encode()
        code, out = http(dashboard + "/api/kill", body, {**ACTION, "Origin": page.rstrip("/")})
        assert code == 403 and "origin" in json.loads(out)["error"], out
        code, out = http(dashboard + "/api/kill?replica_id=victim", b"", {"X-FT-Request": "1"})
        assert code == 415, out
        assert kills == [] and victim.proc.poll() is None

        # The same kill as the dashboard's own page sends it works (so this test can fail).
        code, out = http(dashboard + "/api/kill", body, {**ACTION, "Origin": dashboard})
        assert code == 200 and json.loads(out) == {"killed": "victim"}, out
        assert kills == ["victim"]
        assert victim.proc.wait(15) == 1


# --- connection exhaustion ---------------------------------------------------------------


def test_slow_clients_holding_connections_do_not_starve_the_dashboard(clean_env):
    idle_timeout, cap = 1.0, 8
    with lighthouse(dashboard_idle_timeout_s=idle_timeout, dashboard_max_connections=cap) as lh:
        port = lh._http.server_address[1]
        assert_not_starved(port, "/healthz", idle_timeout, cap, lh._http.open_connections)
        code, body = raw_get(port, "/api/status", timeout=5)
        assert code == 200 and json.loads(body)["config"]["min_replicas"] == 1


def test_dashboard_defaults_bound_idle_connections():
    from ft.coordination import lighthouse as lh_mod

    assert 0 < lh_mod.DASHBOARD_IDLE_TIMEOUT_S <= 30
    assert 0 < lh_mod.DASHBOARD_MAX_CONNECTIONS <= 256


# --- information disclosure --------------------------------------------------------------

MANAGER_ADDR = "http://127.0.0.1:9000"
STORE_ADDR = "127.0.0.1:29400"


def _form_quorum(lh: LighthouseServer, secret: Optional[JobSecret] = None) -> None:
    c = LighthouseClient(lh.address(), 5.0, secret=secret)
    try:
        c.heartbeat("group-0", timeout=2.0)
        c.quorum(
            "group-0", 5.0, address=MANAGER_ADDR, store_address=STORE_ADDR, step=1, world_size=1
        )
    finally:
        c.close()
    st = lh.status()
    assert st["quorum"]["members"][0]["address"] == MANAGER_ADDR  # there is something to hide


def _assert_reveals_nothing(text: str) -> None:
    # The store's port as a number of its own: "29400" also turns up inside timings
    # (6.929400115e-05).
    assert "127.0.0.1:9000" not in text and not re.search(r"(?<![\d.])29400(?!\d)", text), text


@pytest.mark.parametrize("how", ["job_secret", "auth_token", "not_loopback"])
def test_status_without_credentials_reveals_no_manager_addresses(clean_env, how):
    secret = JobSecret.generate()
    token = "dashboard-token-0123456789"
    kw: dict = {
        "job_secret": {"secret": secret},
        "auth_token": {"auth_token": token},
        # Anyone on the network reaches this one, and no credential is configured.
        "not_loopback": {"http_bind": "0.0.0.0:0", "insecure": True},
    }[how]
    with lighthouse(**kw) as lh:
        _form_quorum(lh, secret if how == "job_secret" else None)
        port = lh._http.server_address[1]
        base = f"http://127.0.0.1:{port}"

        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Basic x"},
            {"Authorization": "Bearer " + secret.export()[:-1]},
        ):
            code, out = http(base + "/api/status", headers=headers)
            _assert_reveals_nothing(out)
            if how == "not_loopback":
                st = json.loads(out)
                assert code == 200 and st["config"]["addresses_hidden"] is True
                assert [m["replica_id"] for m in st["quorum"]["members"]] == ["group-0"]
                assert st["quorum"]["members"][0]["address"] == ""
            else:
                assert code == 401 and json.loads(out)["auth_required"] is True
        # What stays open never lists an address either.
        for path in ("/", "/metrics", "/healthz"):
            code, out = http(base + path)
            assert code == 200
            _assert_reveals_nothing(out)
        # Actions are no way around it.
        code, out = http(base + "/api/kill", json.dumps({"replica_id": "group-0"}).encode(), ACTION)
        _assert_reveals_nothing(out)

        if how != "not_loopback":  # the credential shows everything (so this test can fail)
            if how == "auth_token":
                good = {"Authorization": "Bearer " + token}
            else:  # a session signed in with a login ticket (the secret itself never travels)
                req = urllib.request.Request(
                    base + "/api/login",
                    json.dumps({"credential": login_ticket(secret)}).encode(),
                    ACTION,
                )
                with urllib.request.urlopen(req, timeout=5) as r:
                    good = {"Cookie": r.headers["Set-Cookie"].split(";")[0]}
            code, out = http(base + "/api/status", headers=good)
            assert code == 200 and MANAGER_ADDR in out, out
            assert json.loads(out)["config"]["addresses_hidden"] is False


def test_dns_rebinding_cannot_reach_an_open_loopback_dashboard(clean_env):
    """With no credential and a loopback listener, a page whose name an attacker re-pointed
    at 127.0.0.1 is same-origin to the browser; its requests name that site as Host."""
    with lighthouse() as lh:
        _form_quorum(lh)
        port = lh._http.server_address[1]
        base = f"http://127.0.0.1:{port}"
        evil = {"Host": f"attacker.example:{port}"}
        code, out = http(base + "/api/status", headers=evil)
        assert code == 403
        _assert_reveals_nothing(out)
        code, out = http(
            base + "/api/kill",
            json.dumps({"replica_id": "group-0"}).encode(),
            {**ACTION, **evil, "Origin": f"http://attacker.example:{port}"},
        )
        assert code == 403, out
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost"):
            code, out = http(base + "/api/status", headers={"Host": host})
            assert code == 200 and MANAGER_ADDR in out, (host, out)
