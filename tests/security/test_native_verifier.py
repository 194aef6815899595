"""The native gRPC server checks request signatures in C++ (RequestVerifier in
csrc/grpc_server/request_auth.hpp), and the native client signs there (RequestSigner).
ft.utils.auth.Verifier is the specification: on every token of a table, and on randomized ones,
both give the same verdict and the same reason, and the C++ signer's tokens verify by it."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft.coordination.rpc_server import native_available
from ft.utils.auth import GRPC_PURPOSE, AuthError, JobSecret, Signer, Verifier, new_server_id

pytestmark = pytest.mark.skipif(
    not native_available(), reason="native gRPC server not built (no gRPC C++)"
)

SECRET = JobSecret("native-verifier-secret-0123456789abcdef")
WHAT = "/torchft.LighthouseService/Quorum"
SID = new_server_id()  # the server life both verifiers stand for
OTHER_SID = new_server_id()


def both():
    """A fresh pair (own replay caches) built from one key, window and server id."""
    from ft.coordination import _grpc_server

    spec = Verifier(SECRET, GRPC_PURPOSE, server_id=SID)
    key, skew_ms, max_nonces, sid = spec.native_config()
    return spec, _grpc_server.RequestVerifier(key, skew_ms, max_nonces, sid)


def python_verdict(v: Verifier, what: str, body: bytes, token: str) -> str:
    try:
        v.verify(what, body, token)
        return ""
    except AuthError as e:
        return str(e)


def good_token(what: str = WHAT, body: bytes = b"body", ms: int = None, sid: str = SID) -> str:
    if ms is None:
        return Signer(SECRET, GRPC_PURPOSE).sign(what, body, sid)
    # A genuine signature made at another time (the clock-window cases).
    from ft.utils import auth

    nonce = "ab" * 16
    mac = auth._mac(SECRET.key(GRPC_PURPOSE), what, str(ms), nonce, body, sid)
    return f"v2.{ms}.{nonce}.{sid}.{mac}"


def cases():
    now = int(time.time() * 1000)
    good = good_token()
    v, ms, nonce, sid, mac = good.split(".")
    unbound = Signer(SECRET, GRPC_PURPOSE).sign(WHAT, b"body")  # v1: no server id
    other_key = Signer(JobSecret("another-job-secret-0123456789abcdef"), GRPC_PURPOSE)
    return [
        ("good", WHAT, b"body", good),
        ("empty", WHAT, b"body", ""),
        ("four parts", WHAT, b"body", f"{v}.{ms}.{nonce}.{mac}"),
        ("six parts", WHAT, b"body", good + ".x"),
        ("wrong version", WHAT, b"body", f"v3.{ms}.{nonce}.{sid}.{mac}"),
        ("v1 token (not bound to a server)", WHAT, b"body", unbound),
        ("ms not digits", WHAT, b"body", f"{v}.12a.{nonce}.{sid}.{mac}"),
        ("negative ms", WHAT, b"body", f"{v}.-{ms}.{nonce}.{sid}.{mac}"),
        ("19-digit ms", WHAT, b"body", f"{v}.{'9' * 19}.{nonce}.{sid}.{mac}"),
        ("short nonce", WHAT, b"body", f"{v}.{ms}.{nonce[:-1]}.{sid}.{mac}"),
        ("server id upper case", WHAT, b"body", f"{v}.{ms}.{nonce}.{sid.upper()}.{mac}"),
        ("short server id", WHAT, b"body", f"{v}.{ms}.{nonce}.{sid[:-1]}.{mac}"),
        # the server id moved, the signature kept: the signature covers it
        ("server id altered", WHAT, b"body", f"{v}.{ms}.{nonce}.{OTHER_SID}.{mac}"),
        # genuine, made for another server (or this one's earlier life)
        ("signed for another server", WHAT, b"body", good_token(sid=OTHER_SID)),
        ("altered body", WHAT, b"bodY", good),
        ("other method", "/torchft.LighthouseService/Heartbeat", b"body", good),
        ("mac upper case", WHAT, b"body", f"{v}.{ms}.{nonce}.{sid}.{mac.upper()}"),
        ("truncated mac", WHAT, b"body", f"{v}.{ms}.{nonce}.{sid}.{mac[:-2]}"),
        ("other secret", WHAT, b"body", other_key.sign(WHAT, b"body", SID)),
        ("too old", WHAT, b"body", good_token(ms=now - 10 * 60 * 1000)),
        ("from the future", WHAT, b"body", good_token(ms=now + 10 * 60 * 1000)),
        ("empty body", WHAT, b"", good_token(body=b"")),
        ("binary body", WHAT, bytes(range(256)), good_token(body=bytes(range(256)))),
    ]


CASE_NAMES = [c[0] for c in cases()]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_native_check_gives_the_specifications_verdict_and_reason(name):
    # The tokens are made when the test runs: signed at collection they could be stale by now.
    _, what, body, token = next(c for c in cases() if c[0] == name)
    spec, native = both()
    expected = python_verdict(spec, what, body, token)
    assert native.verify(what, body, token) == expected
    if name in ("good", "empty body", "binary body"):
        assert expected == ""
    else:
        assert expected != ""
    if name == "signed for another server":
        assert expected.startswith("signed for another server")
    if name == "v1 token (not bound to a server)":
        assert "not bound to a server" in expected


def test_a_replay_is_refused_by_both_the_same_way():
    spec, native = both()
    token = good_token()
    assert python_verdict(spec, WHAT, b"body", token) == native.verify(WHAT, b"body", token) == ""
    again_py = python_verdict(spec, WHAT, b"body", token)
    again_native = native.verify(WHAT, b"body", token)
    assert again_native == again_py and "replayed" in again_native


@settings(max_examples=300, deadline=None)
@given(
    body=st.binary(max_size=64),
    what=st.sampled_from([WHAT, "/x", ""]),
    tamper=st.one_of(
        st.none(),
        st.tuples(st.integers(0, 200), st.characters(min_codepoint=32, max_codepoint=126)),
    ),
)
def test_randomized_tokens_get_the_same_verdict(body, what, tamper):
    spec, native = both()
    token = good_token(what, body)
    if tamper is not None:
        i, c = tamper
        i %= len(token)
        token = token[:i] + c + token[i + 1 :]
    assert native.verify(what, body, token) == python_verdict(spec, what, body, token)


def test_native_signer_tokens_verify_by_the_specification_once_each():
    """The native client signs in C++ (request_auth.hpp RequestSigner): its tokens verify by
    ft.utils.auth.Verifier, are fresh on every call, and bind the method and the body."""
    from ft.coordination import _grpc_server

    spec = Verifier(SECRET, GRPC_PURPOSE, server_id=SID)
    signer = _grpc_server.RequestSigner(Signer(SECRET, GRPC_PURPOSE).key)
    # until told the server's id it signs for none (all zeros), which no server has
    assert "another server" in python_verdict(spec, WHAT, b"body", signer.token(WHAT, b"body"))
    signer.set_server_id(SID)
    tokens = [signer.token(WHAT, b"body") for _ in range(100)]
    assert len(set(tokens)) == 100
    for t in tokens:
        assert python_verdict(spec, WHAT, b"body", t) == ""
    assert "replayed" in python_verdict(spec, WHAT, b"body", tokens[0])
    assert "bad signature" in python_verdict(spec, "/x", b"body", signer.token(WHAT, b"body"))
    assert "bad signature" in python_verdict(spec, WHAT, b"other", signer.token(WHAT, b"body"))
    other_job = _grpc_server.RequestSigner(
        Signer(JobSecret("another-job-secret-0123456789abcdef"), GRPC_PURPOSE).key
    )
    other_job.set_server_id(SID)
    signer.set_server_id(OTHER_SID)
    assert "another server" in python_verdict(spec, WHAT, b"body", signer.token(WHAT, b"body"))
    assert "bad signature" in python_verdict(spec, WHAT, b"body", other_job.token(WHAT, b"body"))


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=200), cut=st.integers(0, 300))
def test_split_signed_gives_back_the_request_and_refuses_a_broken_field(body, cut):
    """split_signed(sign_request(m, body)) is (body, a token that verifies); any truncation of
    the signed bytes either loses the field (no token) or yields a token that does not verify."""
    from ft.utils.auth import split_signed

    spec = Verifier(SECRET, GRPC_PURPOSE, server_id=SID)
    signed = Signer(SECRET, GRPC_PURPOSE).sign_request(WHAT, body, SID)
    request, token = split_signed(signed)
    assert request == body
    cut_request, cut_token = split_signed(signed[: min(cut, len(signed))])
    if cut < len(signed):
        assert python_verdict(spec, WHAT, cut_request, cut_token) != ""
    assert python_verdict(spec, WHAT, request, token) == ""
    assert split_signed(body) == (body, "") or body.startswith(signed[:3])


def _signed_field(token: bytes, length: int = -1) -> bytes:
    from ft.utils.auth import _AUTH_TAG, _varint

    return _AUTH_TAG + _varint(len(token) if length < 0 else length) + token


@settings(max_examples=400, deadline=None)
@given(
    data=st.one_of(
        st.binary(max_size=300),
        # a leading auth field, well formed or not: any token bytes, any declared length
        st.builds(
            lambda tok, n, rest: _signed_field(tok, n) + rest,
            st.binary(max_size=300),
            st.integers(-1, 400),
            st.binary(max_size=40),
        ),
    )
)
def test_cpp_and_python_take_the_auth_field_off_the_same_way(data):
    """The native server's parse (request_auth.hpp splitSigned) and ft.utils.auth.split_signed
    give the same request and the same token on every input, hostile ones included."""
    from ft.coordination import _grpc_server
    from ft.utils.auth import split_signed

    request, token = split_signed(data)
    offset, native_token = _grpc_server.split_signed(data)
    assert data[offset:] == request
    assert native_token.decode("ascii") == token


@settings(max_examples=200, deadline=None)
@given(token=st.binary(min_size=1, max_size=160))
def test_binary_tokens_get_the_same_verdict_and_never_raise(token):
    """Token bytes come from the request body now (any bytes, not just header-safe ASCII):
    both verifiers refuse them with the same reason, and Python's never raises anything but
    AuthError."""
    spec, native = both()
    text = token.decode("latin-1")
    assert native.verify(WHAT, b"body", text) == python_verdict(spec, WHAT, b"body", text)
