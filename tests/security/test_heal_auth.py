"""Attacks on healing: a source that is not a member of the job tries to feed a replica its
weights, or to learn something it can use against the real sources; a peer without the secret
tries to download the model. Each test asserts what the victim keeps: its weights (nothing is
returned), its secret (never sent), and the real source's willingness to serve the real job."""

from __future__ import annotations

import http.client
import http.server
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from urllib.parse import urlsplit

import pytest
import torch

from ft.checkpointing import HTTPTransport
from ft.checkpointing.transport import CheckpointAuthError, CheckpointError

TO = timedelta(seconds=10)
SECRET = "job-secret-for-heal-tests-0123456789"
WRONG = "not-the-job-secret-0123456789abcdef"
STEP = 7


def transport(**kw) -> HTTPTransport:
    kw.setdefault("advertise_host", "127.0.0.1")
    kw.setdefault("bind_host", "127.0.0.1")
    kw.setdefault("same_host", False)
    return HTTPTransport(TO, 2, **kw)


def state(w: float) -> dict:
    return {
        "model": {"w": torch.full((64, 64), w), "b": torch.arange(10.0) * w},
        "optim": {"step": STEP, "m": torch.full((128,), w / 2)},
    }


@pytest.mark.parametrize("source_secret", [None, WRONG], ids=["no-secret", "wrong-secret"])
def test_poisoned_source_with_correct_checksums_is_not_loaded(source_secret):
    # The fake source is a complete checkpoint server: its CRCs are right, only the weights
    # (w = 666) and the secret are wrong.
    with transport(secret=source_secret) as fake, transport(secret=SECRET) as victim:
        fake.send_checkpoint([1], STEP, state(666.0), TO)
        with pytest.raises(CheckpointAuthError) as e:
            victim.recv_checkpoint(0, fake.metadata(), STEP, TO)
        msg = str(e.value)
        assert SECRET not in msg
        assert ("not signed with the job secret" in msg) or ("403" in msg), msg
        # the victim is still usable: a real member heals it, bit for bit
        with transport(secret=SECRET) as real:
            real.send_checkpoint([1], STEP, state(1.0), TO)
            got = victim.recv_checkpoint(0, real.metadata(), STEP, TO)
        expect = state(1.0)
        for k in ("w", "b"):
            assert torch.equal(got["model"][k], expect["model"][k])
        assert torch.equal(got["optim"]["m"], expect["optim"]["m"])


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A non-member posing as a source: records what healers send it, answers 404."""

    captured: list = []

    def do_GET(self):  # noqa: N802
        type(self).captured.append((self.path, dict(self.headers)))
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_fake_source_learns_no_credential_usable_at_the_real_source():
    _Recorder.captured = []
    fake = http.server.HTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(
        target=fake.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        with transport(secret=SECRET) as real, transport(secret=SECRET) as victim:
            real.send_checkpoint([1], STEP, state(1.0), TO)
            fake_url = f"http://127.0.0.1:{fake.server_address[1]}"
            with pytest.raises(CheckpointError):  # whatever the fake answers, nothing loads
                victim.recv_checkpoint(0, fake_url, STEP, timedelta(seconds=3))
            assert _Recorder.captured, "the victim never asked the fake source"
            real_addr = urlsplit(real.metadata()).netloc
            for path, headers in _Recorder.captured:
                assert SECRET not in repr(headers)  # no bearer secret, only a signature
                auth = headers.get("Authorization", "")
                assert auth.startswith("FT-HMAC ")
                # the attack: replay the captured request at the real source
                req = urllib.request.Request(
                    f"http://{real_addr}{path}", headers={"Authorization": auth}
                )
                with pytest.raises(urllib.error.HTTPError) as e:
                    urllib.request.urlopen(req, timeout=5)
                assert e.value.code == 403
            # the real source still serves the job
            got = victim.recv_checkpoint(0, real.metadata(), STEP, TO)
            assert torch.equal(got["model"]["w"], state(1.0)["model"]["w"])
    finally:
        fake.shutdown()
        fake.server_close()
        thread.join(5)


def test_a_peer_without_the_secret_cannot_download_the_model():
    with transport(secret=SECRET) as src:
        src.send_checkpoint([1], STEP, state(3.0), TO)
        base = src.metadata().split("#")[0]
        for headers in (
            {},
            {"Authorization": "Bearer " + SECRET},
            {"Authorization": "FT-HMAC v1.1.00000000000000000000000000000000.00"},
        ):
            req = urllib.request.Request(f"{base}/ft/v1/checkpoint/{STEP}/meta", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=5)
            assert e.value.code == 403
        with transport(secret=None) as outsider, transport(secret=WRONG) as wrong:
            for rx in (outsider, wrong):
                with pytest.raises(CheckpointAuthError):
                    rx.recv_checkpoint(0, src.metadata(), STEP, TO)


def test_a_replayed_checkpoint_request_is_refused():
    captured = {}
    with transport(secret=SECRET) as src, transport(secret=SECRET) as rx:
        src.send_checkpoint([1], STEP, state(2.0), TO)
        real_open = rx._open

        def spy(host, port, path, deadline, where, secure=False):
            out = real_open(host, port, path, deadline, where, secure)
            captured.setdefault("first", (host, port, path, out[3].decode()))
            return out

        rx._open = spy
        rx.recv_checkpoint(0, src.metadata(), STEP, TO)
        host, port, path, token = captured["first"]
        req = urllib.request.Request(
            f"http://{host}:{port}{path}", headers={"Authorization": f"FT-HMAC {token}"}
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 403
        assert b"replayed" in e.value.read()


def test_heal_over_tls_and_a_plain_text_client_gets_nothing(test_pki):
    from ft.utils.tls import TLSConfig

    tls = TLSConfig(cert_file=test_pki["cert"], key_file=test_pki["key"], ca_file=test_pki["ca"])
    with transport(secret=SECRET, tls=tls) as src, transport(secret=SECRET, tls=tls) as rx:
        src.send_checkpoint([1], STEP, state(5.0), TO)
        assert src.metadata().startswith("https://127.0.0.1:")
        got = rx.recv_checkpoint(0, src.metadata(), STEP, TO)
        assert torch.equal(got["model"]["w"], state(5.0)["model"]["w"])
        # plain HTTP to the TLS port: no answer that carries the model
        plain = src.metadata().replace("https://", "http://").split("#")[0]
        with pytest.raises((OSError, http.client.HTTPException)):  # reset, refused or garbled
            urllib.request.urlopen(f"{plain}/ft/v1/checkpoint/{STEP}/meta", timeout=5)
        # a receiver without the CA refuses to talk to it, with a message that says why
        with transport(secret=SECRET) as no_ca:
            with pytest.raises(Exception, match="FT_TLS_CA_FILE"):
                no_ca.recv_checkpoint(0, src.metadata(), STEP, TO)
