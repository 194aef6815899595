"""Fixtures of the security tests: the coordination tests' real servers and reaped children."""

import os
import subprocess

import pytest

from tests.coordination.conftest import (  # noqa: F401  (the coordination tests' fixtures)
    children,
    lighthouse_factory,
    manager_factory,
)


def make_test_pki(directory: str) -> dict:
    """A throwaway CA and one certificate for 127.0.0.1 / localhost, made with openssl."""

    def run(*argv: str) -> None:
        subprocess.run(
            ["openssl", *argv],
            cwd=directory,
            check=True,
            timeout=60,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    ext = os.path.join(directory, "san.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    # a new P-256 key (unencrypted) with its request: "-x509" self-signs it (the CA)
    new_key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    ca = ("-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ft test CA")
    run("req", "-x509", *new_key, *ca)
    run("req", *new_key, "-keyout", "host.key", "-out", "host.csr", "-subj", "/CN=localhost")
    run(
        "x509",
        "-req",
        "-in",
        "host.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "host.pem",
        "-days",
        "2",
        "-extfile",
        ext,
    )
    return {
        name: os.path.join(directory, f)
        for name, f in (("cert", "host.pem"), ("key", "host.key"), ("ca", "ca.pem"))
    }


@pytest.fixture(scope="session")
def test_pki(tmp_path_factory):
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make test certificates)")
    return make_test_pki(str(tmp_path_factory.mktemp("pki")))
