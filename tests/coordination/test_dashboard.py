"""The lighthouse dashboard: HTTP endpoints, /metrics, auth on kill, and headless Chromium."""

import base64
import json
import re
import shutil
import struct
import time
import urllib.error
import urllib.request
import zlib

import pytest

from ft.coordination import LighthouseClient
from tests.coordination._helpers import free_port, parallel, wait_for


def http(url, data=None, headers=None, timeout=5.0):
    req = urllib.request.Request(
        url, data=data, headers=headers or {}, method="POST" if data is not None else "GET"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def form(lh, *rids, **kw):
    c = LighthouseClient(lh.address(), 5.0)
    for rid in rids:
        c.heartbeat(rid, timeout=1.0)
    qs = parallel(
        [
            lambda rid=rid, i=i: c.quorum(
                rid, 5.0, step=10 + i, world_size=4, address=f"http://127.0.0.1:{9000 + i}", **kw
            )
            for i, rid in enumerate(rids)
        ]
    )
    assert all(not isinstance(q, BaseException) for q in qs), qs
    return c, qs[0]


def test_page_status_and_metrics(lighthouse_factory):
    lh = lighthouse_factory(min_replicas=1, heartbeat_timeout_ms=5000)
    base = lh.dashboard_address()
    code, ctype, page = http(base + "/")
    assert code == 200 and ctype.startswith("text/html")
    # Self-contained: no external scripts, styles or fetches.
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    assert "http://" not in page and "https://" not in page
    assert "setInterval(refresh" in page
    _, q = form(lh, "a", "b")
    code, ctype, body = http(base + "/api/status")
    st = json.loads(body)
    assert st["quorum"]["quorum_id"] == q.quorum_id
    assert [m["replica_id"] for m in st["quorum"]["members"]] == ["a", "b"]
    assert [m["recovering"] for m in st["quorum"]["members"]] == [True, False]
    assert st["quorum"]["members"][0]["world_size"] == 4
    assert "issued" in st["next_quorum"]["reason"] or "waiting" in st["next_quorum"]["reason"]
    assert st["config"]["auth_required"] is False
    assert st["config"]["addresses_hidden"] is False  # loopback: addresses shown
    assert st["quorum"]["members"][0]["address"] == "http://127.0.0.1:9000"
    code, ctype, metrics = http(base + "/metrics")
    assert code == 200 and ctype.startswith("text/plain")
    assert f"ft_lighthouse_quorum_id {q.quorum_id}\n" in metrics
    assert "ft_lighthouse_quorum_members 2\n" in metrics
    assert re.search(r'ft_lighthouse_heartbeat_age_seconds\{replica_id="a"\} [0-9.]+', metrics)
    assert re.search(r"ft_lighthouse_quorum_latency_seconds [0-9.e-]+", metrics)
    for line in metrics.splitlines():  # Prometheus text syntax
        assert line.startswith("#") or re.match(
            r'^[a-z_]+(\{[a-z_]+="[^"]*"\})? -?[0-9.e+-]+$', line
        ), line
    assert http(base + "/nope")[0] == 404
    assert "127.0.0.1:9000" not in metrics  # /metrics is open: it lists no address


# What the dashboard's own page sends with an action (dashboard/index.html).
ACTION = {"Content-Type": "application/json", "X-FT-Request": "1"}


def test_kill_requires_token(lighthouse_factory, children, monkeypatch):
    monkeypatch.setenv("FT_AUTH_TOKEN", "s3cret")
    lh = lighthouse_factory(min_replicas=1)
    base = lh.dashboard_address()
    child = children("manager", "victim", lh.address(), "1")
    child.address()
    wait_for(lambda: any(r["replica_id"] == "victim" for r in lh.status()["replicas"]))
    from ft.coordination import ManagerClient

    ManagerClient(child.address(), 5.0)._quorum(0, 0, "", False, 5.0)
    body = json.dumps({"replica_id": "victim"}).encode()
    assert http(base + "/api/kill", body, ACTION)[0] == 401
    assert http(base + "/api/kill", body, {**ACTION, "Authorization": "Bearer wrong"})[0] == 401
    assert http(base + "/api/kill", body, {**ACTION, "Authorization": "Bearer "})[0] == 401
    # The status lists the managers' addresses: it needs the token too.
    code, _, out = http(base + "/api/status")
    assert code == 401 and json.loads(out)["auth_required"] is True and "127.0.0.1" not in out
    ok = {**ACTION, "Authorization": "Bearer s3cret"}
    st = json.loads(http(base + "/api/status", headers={"Authorization": "Bearer s3cret"})[2])
    assert st["config"]["auth_required"] is True
    assert http(base + "/api/kill", json.dumps({"replica_id": "ghost"}).encode(), ok)[0] == 404
    assert http(base + "/api/kill", b"{not json", ok)[0] == 400
    assert http(base + "/api/kill", b"{}", ok)[0] == 400
    assert http(base + "/api/kill", b"[]", ok)[0] == 400
    # The token does not stand in for the request header, nor a form body for JSON.
    assert (
        http(
            base + "/api/kill",
            body,
            {"Content-Type": "application/json", "Authorization": "Bearer s3cret"},
        )[0]
        == 403
    )
    assert http(base + "/api/kill", body, {**ok, "Content-Type": "text/plain"})[0] == 415
    assert (
        http(base + "/api/kill?replica_id=victim", b"", {**ok, "Content-Type": "text/plain"})[0]
        == 415
    )
    assert http(base + "/api/kill?replica_id=victim", b"{}", ok)[0] == 400
    assert child.proc.poll() is None
    code, _, out = http(base + "/api/kill", body, ok)
    assert code == 200, out
    assert child.wait(10) == 1


def test_kill_without_token_configured(lighthouse_factory, children, monkeypatch):
    monkeypatch.delenv("FT_AUTH_TOKEN", raising=False)
    lh = lighthouse_factory(min_replicas=1)
    child = children("manager", "victim2", lh.address(), "1")
    from ft.coordination import ManagerClient

    ManagerClient(child.address(), 5.0)._quorum(0, 0, "", False, 5.0)
    url, body = lh.dashboard_address() + "/api/kill", json.dumps({"replica_id": "victim2"}).encode()
    # Even with no token configured, an action needs the header a cross-site page cannot send
    # and, when the browser names an origin, this dashboard's own.
    code, _, out = http(url, body, {"Content-Type": "application/json"})
    assert code == 403 and "X-FT-Request" in json.loads(out)["error"], out
    code, _, out = http(url, body, {**ACTION, "Origin": "http://evil.example"})
    assert code == 403 and "origin" in json.loads(out)["error"], out
    assert child.proc.poll() is None
    origin = lh.dashboard_address()  # http://127.0.0.1:PORT: what urllib sends as Host
    code, _, out = http(url, body, {**ACTION, "Origin": origin})
    assert code == 200, out
    assert child.wait(10) == 1


# --- headless Chromium ------------------------------------------------------------------

CHROMIUM = (
    shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
)
CHROMEDRIVER = shutil.which("chromedriver")
ALIVE_RGB = (0x00, 0xC8, 0x53)  # --alive in dashboard/index.html: the member swatch colour


def png_pixels(data: bytes):
    """Minimal PNG decoder (8-bit RGB/RGBA, non-interlaced): returns (w, h, rows of RGB tuples)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    w = h = bpp = 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, chunk = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
    raw = zlib.decompress(idat)
    stride = w * bpp
    rows, prev = [], bytearray(stride)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append([tuple(line[x * bpp : x * bpp + 3]) for x in range(w)])
        prev = line
    return w, h, rows


def count_swatches(rows, rgb, tol=8):
    """Number of separate vertical runs of rows containing the colour (one per table row)."""
    runs, inside = 0, False
    for row in rows:
        hit = sum(1 for p in row if all(abs(p[i] - rgb[i]) <= tol for i in range(3))) >= 6
        if hit and not inside:
            runs += 1
        inside = hit
    return runs


class WebDriver:
    """Just enough of the W3C WebDriver protocol over urllib (no selenium dependency)."""

    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}"
        caps = {
            "capabilities": {
                "alwaysMatch": {
                    "goog:chromeOptions": {
                        "binary": CHROMIUM,
                        "args": [
                            "--headless=new",
                            "--no-sandbox",
                            "--disable-gpu",
                            "--disable-dev-shm-usage",
                            "--window-size=1200,1000",
                            "--force-device-scale-factor=1",
                            "--hide-scrollbars",
                            "--no-first-run",
                        ],
                    }
                }
            }
        }
        self.sid = self.cmd("POST", "/session", caps)["sessionId"]

    def cmd(self, method, path, body=None, timeout=30):
        data = json.dumps(body or {}).encode() if method == "POST" else None
        req = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())["value"]

    def s(self, method, path, body=None):
        return self.cmd(method, f"/session/{self.sid}{path}", body)

    def run(self, script):
        return self.s("POST", "/execute/sync", {"script": script, "args": []})

    def quit(self):
        try:
            self.cmd("DELETE", f"/session/{self.sid}", timeout=10)
        except Exception:
            pass


@pytest.fixture
def webdriver(tmp_path, procs):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("headless Chromium not available: apt-get install -y chromium chromium-driver")
    port = free_port()
    proc = procs([CHROMEDRIVER, f"--port={port}"], log_path=tmp_path / "chromedriver.log")
    driver = None
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=1).read()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.skip("chromedriver did not start")
                time.sleep(0.1)
        driver = WebDriver(port)
        yield driver
    finally:
        if driver is not None:
            driver.quit()
        proc.kill(grace=10)


def test_dashboard_renders_members_in_chromium(lighthouse_factory, webdriver, tmp_path):
    lh = lighthouse_factory(min_replicas=1, heartbeat_timeout_ms=20000)
    members = ["replica-a", "replica-b", "replica-c"]
    c, q = form(lh, *members)
    for rid in members:  # same step everywhere: every member rendered as alive (green swatch)
        c.heartbeat(rid, timeout=1.0)
    parallel([lambda rid=rid: c.quorum(rid, 5.0, step=5, world_size=4) for rid in members])
    webdriver.s("POST", "/url", {"url": lh.dashboard_address() + "/"})
    deadline = time.monotonic() + 15
    while webdriver.run("return document.querySelectorAll('#members tr.member').length") != 3:
        assert time.monotonic() < deadline, "members never rendered"
        time.sleep(0.1)
    rendered = webdriver.run(
        "return [...document.querySelectorAll('#members tr.member')].map(r => r.dataset.replica)"
    )
    assert rendered == members
    assert webdriver.run("return document.getElementById('quorum-id').textContent") == str(
        lh.status()["quorum"]["quorum_id"]
    )
    assert webdriver.run("return document.querySelectorAll('button.kill').length") == 3
    png = base64.b64decode(webdriver.s("GET", "/screenshot"))
    (tmp_path / "dashboard.png").write_bytes(png)
    w, h, rows = png_pixels(png)
    assert w >= 800 and h >= 600
    assert count_swatches(rows, ALIVE_RGB) == 3, (
        "screenshot should show one green swatch per member"
    )


def test_dashboard_page_signs_in_with_a_login_link_and_kills_in_chromium(
    lighthouse_factory, children, webdriver
):
    """The page signs in with a login link (the job secret never reaches the browser; the
    session is an HttpOnly cookie), a cross-site page in the signed-in browser still cannot
    kill (tests/security), and the page's own kill (header, JSON body, session) works."""
    import os

    from ft.coordination import ManagerClient
    from ft.utils.auth import JobSecret
    from ft.utils.dashboard_login import login_url
    from tests.security.test_dashboard_http import attacker_site, count_kills

    secret = JobSecret.generate()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FT_")}
    env["FT_JOB_SECRET"] = secret.export()
    lh = lighthouse_factory(min_replicas=1, heartbeat_timeout_ms=20000, secret=secret)
    child = children("manager", "victim", lh.address(), "1", env=env)
    with ManagerClient(child.address(), 5.0, secret=secret, replica_id="victim") as rank0:
        rank0._quorum(0, 0, "", False, 5.0)
    kills = count_kills(lh)
    dashboard = lh.dashboard_address()

    def members() -> int:
        return webdriver.run("return document.querySelectorAll('#members tr.member').length")

    webdriver.s("POST", "/url", {"url": dashboard + "/"})
    deadline = time.monotonic() + 20
    while not webdriver.run("return !!document.querySelector('#error .signin')"):
        assert time.monotonic() < deadline, "the page never asked to sign in"
        time.sleep(0.1)
    assert members() == 0
    # The operator pastes a login link into the open tab (a change of fragment only).
    link = login_url(dashboard, secret)
    webdriver.s("POST", "/url", {"url": link})
    while members() != 1:
        assert time.monotonic() < deadline, "members never rendered after signing in"
        time.sleep(0.1)
    assert webdriver.run("return location.hash") == ""  # the ticket left the address bar
    assert webdriver.run("return document.cookie") == ""  # HttpOnly: no script reads it
    assert secret.export() not in webdriver.run("return document.documentElement.outerHTML")

    # A page of another origin, opened in the signed-in browser, tries every kill it can.
    with attacker_site(dashboard) as (page, reports):
        webdriver.s("POST", "/url", {"url": page})
        while not reports:
            assert time.monotonic() < deadline + 20, "the attacker page never reported back"
            time.sleep(0.1)
    time.sleep(0.5)  # anything still in flight lands
    assert reports[0]["no_cors_json_as_text_plain"] == "sent:opaque", reports  # it ran
    assert reports[0]["cors_read_status"].startswith("blocked:"), reports
    assert kills == [] and child.proc.poll() is None, reports

    webdriver.s("POST", "/url", {"url": dashboard + "/"})
    while members() != 1:  # still signed in (the cookie), without a new link
        assert time.monotonic() < deadline + 30, "the session did not survive a reload"
        time.sleep(0.1)
    webdriver.run(
        "window.confirm = () => true; window.alert = (m) => { window.lastAlert = m; };"
        "document.querySelector('button.kill').click();"
    )
    while not webdriver.run("return window.lastAlert || ''"):
        assert time.monotonic() < deadline + 30, "the kill never answered"
        time.sleep(0.1)
    assert webdriver.run("return window.lastAlert") == "killed victim"
    assert kills == ["victim"]
    assert child.wait(10) == 1
