#!/usr/bin/env python3
"""Runs torchft's own test suite (0.2.0, or torchft-nightly 2026.10.26) and 0.2.0's example
scripts against ft, imports changed.

Usage:
  .venv/bin/python scripts/torchft_suite.py [--release 0.2.0|nightly] [--files F ...]
      [--examples] [--json OUT]

What it does, each run:
1. Fetches the release's archive from the package index, checks its sha256 against the one
   pinned in ``RELEASES`` and caches it (``--cache``, default /tmp/ft-torchft-suite): torchft
   0.2.0's source distribution (it holds the tests and the example scripts; the wheel lacks
   the examples), or torchft-nightly's wheel (the nightly publishes no sdist; its wheel holds
   the tests). Nothing of torchft is kept in this repository.
2. Installs the suite's own test requirements (pinned below) into the cache with
   ``pip install --target``, not into the venv.
3. Copies the test files (and their helpers: ``_test_utils.py``, ``_test/``, one benchmark a
   test imports) into a fresh temporary directory as the package ``tft_suite`` and rewrites
   their references to torchft (tokens, not text, so comments and log strings stay):
   * ``torchft.X`` → ``ft.X`` (a "public" rewrite, the one a user makes);
   * the suite's own modules (``torchft.*_test``, ``torchft._test*``) → ``tft_suite.*``;
   * the private module paths in ``PRIVATE_MODULES`` → their ft equivalents. A file that needs
     one is reported as such: it runs with more than the import changed;
   * a string that is only a dotted ``torchft.`` path (a ``mock.patch`` target) is rewritten
     the same way and reported.
   ``from torchft.X import _name`` (a private name of a public module) is reported too.
4. Runs pytest on each file in its own process group with a deadline (``--timeout``; torchft's
   pytest settings: 60 s per test, thread method), reaps the group, and prints per file
   passed / failed / errors / skipped and each failing test with a one-line reason. A failure
   listed in ``KNOWN_FAILURES`` (torchft private internals, an environment limit) is shown as
   known; the exit status is 1 when any other test fails or a file times out.
5. With ``--examples``: starts an ft lighthouse on loopback (``--min_replicas 2``) and runs
   torchft's ``train_ddp.py`` and ``train_diloco.py`` as two replica groups, one process each,
   with the imports changed and the run-time substitutions in ``EXAMPLE_SUBSTITUTIONS``
   (printed): fewer steps, a smaller "useless" layer, and, for CIFAR-10 (a download, impossible
   offline), a synthetic data set of the same shape.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import tokenize
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file sees scripts/ on sys.path, not the checkout whose ft it tests (and
# whose ft its children import, through PYTHONPATH).
sys.path.insert(0, str(ROOT))

from ft.coordination.cli import start_lighthouse_process  # noqa: E402


@dataclass(frozen=True)
class Release:
    """One torchft release whose tests the harness runs: its project on the package index, the
    archive fetched (an sdist, or a wheel, read as a zip of sources) and that archive's
    sha256."""

    version: str
    project: str
    archive: str
    sha256: str

    @property
    def is_wheel(self) -> bool:
        return self.archive.endswith(".whl")


RELEASES: Dict[str, Release] = {
    "0.2.0": Release(
        "0.2.0",
        "torchft",
        "torchft-0.2.0.tar.gz",
        "542e17910039735d6686517f98ed49686ba23fc4283b15cf1d984a251eb1546a",
    ),
    # The reconfigure API (ProcessGroup.reconfigure, reconfigure handles through the
    # lighthouse). Only the wheel's Python sources are used, so its CPython tag does not matter.
    "nightly": Release(
        "nightly-2026.10.26",
        "torchft-nightly",
        "torchft_nightly-2026.10.26-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "52d18c8d6c067026461af5ee9fe4239d076cf2ff2803b970ac3b319b8eeb8df0",
    ),
}
DEFAULT_RELEASE = RELEASES["0.2.0"]
VERSION = DEFAULT_RELEASE.version
SDIST = DEFAULT_RELEASE.archive
SDIST_SHA256 = DEFAULT_RELEASE.sha256
DEFAULT_CACHE = Path(os.environ.get("FT_TORCHFT_SUITE_CACHE", "/tmp/ft-torchft-suite"))
SUITE_PKG = "tft_suite"
_RUN_SECRET = secrets.token_hex(32)

# The suite's test requirements (torchft's dev extras that its tests import), pinned.
# tensorboard and absl-py: train_diloco.py's SummaryWriter.
TEST_REQUIREMENTS = (
    "parameterized==0.9.0",
    "expecttest==0.3.0",
    "pytest-timeout==2.4.0",
    "torchdata==0.11.0",
    "tensorboard==2.21.0",
    "absl-py==2.5.1",
)

# torchft's pytest settings (its pyproject.toml, [tool.pytest.ini_options]), except that a test
# past its 60 s fails alone (signal) instead of ending the whole file (thread).
PYTEST_INI = """[pytest]
timeout = 60
timeout_method = signal
log_level = INFO
"""

# Private torchft module paths a test imports, and the ft module holding the same names.
PRIVATE_MODULES: Dict[str, str] = {
    # torchft's compiled extension; the names tests take from it (LighthouseServer, Quorum,
    # QuorumMember, QuorumResult, LighthouseClient) are torchft.coordination's public names.
    "torchft._torchft": "ft.coordination",
    # the reader-writer lock of torchft's checkpoint server.
    "torchft.checkpointing._rwlock": "ft.checkpointing.rwlock",
}

# Modules of torchft that are part of its test suite, not of its library.
SUPPORT_MODULES = (
    "torchft._test_utils",
    "torchft._test",
    "torchft.checkpointing.http_transport_bench",
)

# Tests that fail against ft for a reason other than a gap in ft's public behaviour:
# "file::Class::test" (parameterized variants included by prefix) → reason. docs/migrating.md
# lists the same tests under "torchft's test suite".
_MANAGED_WORK = (
    "builds torchft.manager._ManagedWork(manager, work, value), a private class, and tests its "
    "lazy callback chain; ft's Manager.allreduce returns a Work whose future already carries "
    "the reduced value"
)
_DTENSOR = (
    "its state dict holds a DTensor on a mesh without this rank, compared as a DTensor after "
    "the transfer: ft sends DTensors without pickle, as the local piece plus a description, "
    "and makes them DTensors again only on the receiver's own mesh (a Manager heal)"
)
_JOIN_ROUND_COUNTS = (
    "counts the Manager's calls on a mocked Manager from the first step; ft's LocalSGD and "
    "DiLoCo run a join round (one quorum and allreduce more) before the first inner step "
    "(docs/design.md, DiLoCo), and DiLoCo reads use_async_quorum where the test sets the "
    "mock's _use_async_quorum"
)
_REJOINER_HEALS_FIRST = (
    "compares the restarted replica's parameters step by step with values recorded from "
    "torchft, whose rejoiner takes its first inner steps from its initial parameters (1, -1, "
    "-3) and heals only at its first sync; ft's rejoiner heals in its join round, before its "
    "first inner step (docs/design.md, DiLoCo), so its step 1 is the survivors' state minus "
    "one inner step (-37). The surviving replica's values match torchft's"
)
KNOWN_FAILURES: Dict[str, str] = {
    "local_sgd_test.py::LocalSGDTest::test_local_sgd_healthy": _JOIN_ROUND_COUNTS,
    "local_sgd_test.py::LocalSGDTest::test_local_sgd_recovery": _JOIN_ROUND_COUNTS,
    "local_sgd_test.py::DiLoCoTest": _JOIN_ROUND_COUNTS,
    "diloco_regression_test.py::DiLoCoMockedUpdateTest::test_diloco_mocked_failure_recovery": (
        _REJOINER_HEALS_FIRST
    ),
    "_test/managed_work_test.py::TestManagedWork": _MANAGED_WORK,
    "ddp_test.py::TestDDP::test_ddp": _MANAGED_WORK,
    "futures_test.py": (
        "imports torchft.futures._TIMEOUT_MANAGER (its asyncio timer loop) and sets its private "
        "watchdog interval; ft runs one timer thread and has no such object"
    ),
    "multiprocessing_test.py": (
        "tests torchft.multiprocessing._MonitoredPipe, the pipe to a Baby group's child "
        "process; ft's Baby groups run no child process"
    ),
    "process_group_test.py::ProcessGroupTest::test_reconfigure_baby_process_group": (
        "reads the Baby group's private _future_thread, _future_pipe and _p (its child process)"
    ),
    "process_group_test.py::CreateStoreClientTest::test_parses_addr": (
        "patches torchft.process_group.TCPStore and PrefixStore (the module's imports); ft "
        "probes the store's socket under the deadline before it builds the TCPStore"
    ),
    "process_group_test.py::ProcessGroupTest::test_baby_gloo_apis": (
        "calls num_active_work(), the count of ops in a Baby group's child process (none in ft)"
    ),
    "process_group_test.py::ProcessGroupTest::test_gloo_timeout": (
        "matches torch Gloo's own connect-timeout text; ft's backend connects its own lanes and "
        "says 'could not connect to its peers within 10 ms'"
    ),
    "process_group_test.py::ProcessGroupTest::test_baby_gloo_timeout": (
        "expects the TimeoutError of torchft's child-process pipe; ft raises the backend's "
        "DistBackendError (a RuntimeError)"
    ),
    "checkpointing/http_transport_test.py::TestHTTPTransport::test_checkpoint_server_locking": (
        "reads HTTPTransport's private _checkpoint_lock, _disallowed and _step"
    ),
    "checkpointing/pg_transport_test.py::PGTransportTest::test_pg_transport_gloo": _DTENSOR,
    "parameter_server_test.py::TestParameterServer::test_parameter_server": (
        "listens on this host's address without authentication; ft's ParameterServer serves "
        "beyond loopback only with insecure=True (FT_INSECURE=1)"
    ),
    "manager_integ_test.py::ManagerIntegTest::test_ddp_skip_init_sync": (
        "fails when the test's own threads race (2 of 8 runs here): each replica seeds the "
        "global RNG and builds its model under INIT_LOCK, but the other replica's thread "
        "draws its batches from the same global RNG outside the lock; a draw between the "
        "seed and the model's init gives the replicas different weights (parameter sums "
        "2.513 and 1.245 in a failing run), and with init_sync=False nothing equalizes them"
    ),
    "checkpointing/http_transport_test.py::TestHTTPTransport::test_checkpoint_server": _DTENSOR,
    "checkpointing/http_transport_test.py::TestHTTPTransport::test_multi_http_transport_cpu": (
        _DTENSOR
    ),
}

# torchft-nightly's tests that fail against ft for such a reason, in addition to the above
# (the same tests keep their ids in the nightly).
NIGHTLY_KNOWN_FAILURES: Dict[str, str] = {
    "manager_test.py::TestManagedWork": _MANAGED_WORK,
}


def use_release(release: Release) -> None:
    """Makes ``release``'s known failures the ones ``known_failure`` reports."""
    if release.project == "torchft-nightly":
        KNOWN_FAILURES.update(NIGHTLY_KNOWN_FAILURES)


# ---------------------------------------------------------------------------------------------
# Fetching


def _index_url() -> str:
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        try:
            out = subprocess.run(
                [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            url = out.stdout.strip() if out.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired):
            url = ""
    if not url:
        # pip's own default index: the one `pip install` here uses when none is configured.
        from pip._internal.models.index import PyPI

        url = PyPI.simple_url
    return url.rstrip("/")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(cache: Path, timeout: float = 120.0, release: Release = DEFAULT_RELEASE) -> Path:
    """The release's verified archive in the cache, fetched from the package index's simple
    API if needed."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / release.archive
    if path.exists() and _sha256(path) == release.sha256:
        return path
    page_url = f"{_index_url()}/{release.project}/"
    req = urllib.request.Request(page_url, headers={"Accept": "text/html"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        page = r.read().decode("utf-8", "replace")
    hrefs = [h for h in re.findall(r'href="([^"]+)"', page) if release.archive in h]
    if not hrefs:
        raise RuntimeError(f"{page_url} lists no {release.archive}")
    url = urllib.parse.urljoin(page_url, hrefs[0].replace("&amp;", "&")).split("#")[0]
    tmp = path.with_suffix(f".part{os.getpid()}")
    with urllib.request.urlopen(url, timeout=timeout) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    got = _sha256(tmp)
    if got != release.sha256:
        tmp.unlink()
        raise RuntimeError(f"{release.archive}: sha256 {got}, expected {release.sha256}")
    os.replace(tmp, path)
    return path


def extract_sdist(sdist: Path, cache: Path, release: Release = DEFAULT_RELEASE) -> Path:
    """The directory holding the release's ``torchft`` package (and, for an sdist, the
    example scripts)."""
    dest = cache / f"src-{release.version}"
    top = dest if release.is_wheel else dest / f"torchft-{release.version}"
    if (top / ("torchft/__init__.py" if release.is_wheel else "train_ddp.py")).exists():
        return top
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix="src-"))
    if release.is_wheel:
        with zipfile.ZipFile(sdist) as zf:
            for name in zf.namelist():  # the sources only, checked to stay inside tmp
                if name.startswith("torchft/") and name.endswith((".py", ".json")):
                    if ".." in Path(name).parts:
                        raise RuntimeError(f"{release.archive}: unsafe path {name}")
                    zf.extract(name, tmp)
    else:
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return top


def install_requirements(cache: Path, timeout: float = 600.0) -> Path:
    """The suite's requirements, installed into the cache (the venv stays as it is)."""
    tag = hashlib.sha256("\n".join(TEST_REQUIREMENTS).encode()).hexdigest()[:12]
    target = cache / f"deps-py{sys.version_info[0]}{sys.version_info[1]}-{tag}"
    if (target / ".complete").exists():
        return target
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix="deps-"))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tmp)]
    r = subprocess.run([*cmd, *TEST_REQUIREMENTS], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"pip install of the suite's requirements failed:\n{r.stderr[-2000:]}")
    (tmp / ".complete").write_text("\n".join(TEST_REQUIREMENTS))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


# ---------------------------------------------------------------------------------------------
# Rewriting


@dataclass
class Rewrites:
    public: set = field(default_factory=set)  # torchft.X → ft.X
    support: set = field(default_factory=set)  # the suite's own modules
    private_modules: set = field(default_factory=set)  # PRIVATE_MODULES entries used
    private_names: set = field(default_factory=set)  # "torchft.X._name" imported
    patch_targets: set = field(default_factory=set)  # rewritten dotted-path strings

    def merge(self, other: "Rewrites") -> None:
        for k in vars(self):
            getattr(self, k).update(getattr(other, k))

    def import_only(self) -> bool:
        return not self.private_modules

    def describe(self) -> str:
        if self.private_modules:
            return "private paths mapped"
        return "changed; private names" if self.private_names else "changed"

    def as_dict(self) -> dict:
        return {k: sorted(v) for k, v in vars(self).items()}


def _is_support(parts: Sequence[str]) -> bool:
    dotted = ".".join(parts)
    if any(dotted == m or dotted.startswith(m + ".") for m in SUPPORT_MODULES):
        return True
    return len(parts) > 1 and parts[-1].endswith("_test")


def map_path(parts: Sequence[str], rw: Rewrites) -> str:
    """A dotted path that starts with torchft, as ft's tests see it."""
    for k in range(len(parts), 1, -1):
        prefix = ".".join(parts[:k])
        if prefix in PRIVATE_MODULES:
            rw.private_modules.add(f"{prefix} → {PRIVATE_MODULES[prefix]}")
            return ".".join([PRIVATE_MODULES[prefix], *parts[k:]])
        if _is_support(parts[:k]):
            rw.support.add(prefix)
            return ".".join([SUITE_PKG, *parts[1:]])
    rw.public.add(".".join(parts[:2]))
    return ".".join(["ft", *parts[1:]])


_DOTTED = re.compile(r"torchft(\.[A-Za-z_][A-Za-z0-9_]*)+")


def rewrite_source(source: str) -> Tuple[str, Rewrites]:
    rw = Rewrites()
    line_starts = [0]
    for line in source.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))

    def off(pos: Tuple[int, int]) -> int:
        return line_starts[pos[0] - 1] + pos[1]

    toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    edits: List[Tuple[int, int, str]] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        if (
            t.type == tokenize.NAME
            and t.string == "torchft"
            and (i == 0 or toks[i - 1].string != ".")
        ):
            parts = ["torchft"]
            j = i
            while (
                j + 2 < len(toks)
                and toks[j + 1].string == "."
                and toks[j + 2].type == tokenize.NAME
            ):
                parts.append(toks[j + 2].string)
                j += 2
            is_from = i > 0 and toks[i - 1].string == "from"
            names: List[str] = []
            if is_from and j + 1 < len(toks) and toks[j + 1].string == "import":
                k = j + 2
                while k < len(toks) and toks[k].type not in (tokenize.NEWLINE, tokenize.ENDMARKER):
                    if toks[k].type == tokenize.NAME and toks[k - 1].string != "as":
                        if toks[k].string != "as":
                            names.append(toks[k].string)
                    k += 1
            if names and all(_is_support([*parts, n]) for n in names):
                # `from torchft import _test_utils`: a module of the suite itself
                rw.support.update(".".join([*parts, n]) for n in names)
                new = ".".join([SUITE_PKG, *parts[1:]])
            else:
                new = map_path(parts, rw)
                if new.startswith("ft"):
                    for n in names:
                        if n.startswith("_"):
                            rw.private_names.add(f"{'.'.join(parts)}.{n}")
            edits.append((off(t.start), off(toks[j].end), new))
            i = j + 1
            continue
        if t.type == tokenize.STRING:
            m = re.fullmatch(r"([rRbBuUfF]*)(['\"]{1,3})(.*)\2", t.string, re.S)
            if m and _DOTTED.fullmatch(m.group(3)):
                new = map_path(m.group(3).split("."), rw)
                rw.patch_targets.add(m.group(3))
                edits.append(
                    (off(t.start), off(t.end), f"{m.group(1)}{m.group(2)}{new}{m.group(2)}")
                )
        i += 1
    out = source
    for start, end, new in reversed(edits):
        out = out[:start] + new + out[end:]
    return out, rw


# ---------------------------------------------------------------------------------------------
# The test files


def test_files(src: Path) -> List[str]:
    pkg = src / "torchft"
    return sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*_test.py"))


def prepare_suite(src: Path, work: Path) -> Dict[str, Rewrites]:
    """Copies the suite into work/tft_suite, rewritten; returns each test file's rewrites."""
    pkg = src / "torchft"
    dest = work / SUITE_PKG
    rewrites: Dict[str, Rewrites] = {}
    files = [p for p in pkg.rglob("*.py") if p.name.endswith("_test.py")]
    files += [pkg / "_test_utils.py", pkg / "checkpointing" / "http_transport_bench.py"]
    files += list((pkg / "_test").glob("*.py"))
    for path in files:
        rel = path.relative_to(pkg)
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        text, rw = rewrite_source(path.read_text())
        out.write_text(text)
        rewrites[str(rel)] = rw
    for d in [dest, *[p for p in dest.rglob("*") if p.is_dir()]]:
        if d.name != "__pycache__":
            (d / "__init__.py").touch()
    (work / "pytest.ini").write_text(PYTEST_INI)
    # Expected results of diloco_regression_test.py, named by test id: the suite's tests now
    # live in tft_suite, so the ids change with the package name.
    fixtures = work / "test_fixtures"
    fixtures.mkdir(exist_ok=True)
    for f in (src / "test_fixtures").glob("torchft.*.json"):
        shutil.copy(f, fixtures / (SUITE_PKG + f.name[len("torchft") :]))
    # A test's rewrites include those of the suite modules it imports.
    for name, rw in rewrites.items():
        for mod in list(rw.support):
            dep = mod.split(".", 1)[1].replace(".", "/") + ".py" if "." in mod else ""
            if dep in rewrites and dep != name:
                rw.merge(
                    Rewrites(
                        private_modules=rewrites[dep].private_modules,
                        private_names=rewrites[dep].private_names,
                    )
                )
    return rewrites


@dataclass
class FileResult:
    file: str
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    timed_out: bool = False
    failures: List[Tuple[str, str]] = field(default_factory=list)  # (test id, reason)
    skips: List[Tuple[str, str]] = field(default_factory=list)
    output_tail: str = ""


def _one_line(text: Optional[str]) -> str:
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line[:200]
    return "(no message)"


def _kill_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Ends the child's process group (the child and whatever it started) and reaps the child.
    The group outlives its leader while any member runs, so it is signalled even after the
    child itself has exited."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def _start_in_session(cmd: Sequence[str], cwd: Path, env: Dict[str, str], out) -> subprocess.Popen:
    """cmd in a session of its own (``_kill_group`` ends all of it), stdin from /dev/null,
    stdout and stderr into the open file ``out``."""
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def run_command(
    cmd: Sequence[str], cwd: Path, env: Dict[str, str], timeout: float, log: Path
) -> Tuple[Optional[int], float]:
    """Runs cmd in its own session with output to log; (returncode or None on timeout, s)."""
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = _start_in_session(cmd, cwd, env, out)
        try:
            rc: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        _kill_group(proc)
    return rc, time.monotonic() - t0


def _test_env(work: Path, deps: Path) -> Dict[str, str]:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("TORCHFT_") or k in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
            del env[k]
    env["PYTHONPATH"] = os.pathsep.join([str(work), str(ROOT), str(deps)])
    # torchft's tests bind their lighthouses and servers on "[::]:0"; ft serves beyond loopback
    # only with a job secret (docs/security.md), so the suite runs with one, fresh each run.
    env["FT_JOB_SECRET"] = _RUN_SECRET
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def known_failure(test_id: str) -> Optional[str]:
    for key, reason in KNOWN_FAILURES.items():
        if test_id == key or any(test_id.startswith(key + sep) for sep in ("_", "[", "::")):
            return reason
    return None


def run_file(rel: str, work: Path, deps: Path, timeout: float) -> FileResult:
    res = FileResult(rel)
    xml = work / f"junit-{rel.replace('/', '_')}.xml"
    log = work / f"log-{rel.replace('/', '_')}.txt"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        f"{SUITE_PKG}/{rel}",
        "-c",
        str(work / "pytest.ini"),
        "--rootdir",
        str(work),
        "-p",
        "no:cacheprovider",
        "-v",
        "-rA",
        f"--junitxml={xml}",
    ]
    rc, res.seconds = run_command(cmd, work, _test_env(work, deps), timeout, log)
    res.timed_out = rc is None
    text = log.read_text(errors="replace")
    res.output_tail = text[-3000:]
    prefix = f"{SUITE_PKG}/{rel}::"
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            cls = case.get("classname", "").rsplit(".", 1)[-1]
            name = case.get("name", "")
            tid = f"{rel}::{cls}::{name}" if cls and not cls.endswith("_test") else f"{rel}::{name}"
            failure = case.find("failure")
            error = case.find("error")
            skipped = case.find("skipped")
            if failure is not None:
                res.failed += 1
                res.failures.append((tid, _one_line(failure.get("message"))))
            elif error is not None:
                res.errors += 1
                res.failures.append((tid, _one_line(error.get("message"))))
            elif skipped is not None:
                res.skipped += 1
                res.skips.append((tid, _one_line(skipped.get("message"))))
            else:
                res.passed += 1
    else:
        # killed before pytest wrote its report: count what -rA printed so far
        for m in re.finditer(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", text, re.M):
            kind, tid, why = m.group(2), m.group(1).replace(prefix, f"{rel}::"), "see the log"
            if kind == "PASSED":
                res.passed += 1
            elif kind == "SKIPPED":
                res.skipped += 1
            else:
                res.failed += kind == "FAILED"
                res.errors += kind == "ERROR"
                res.failures.append((tid, _one_line(why)))
        if rc is not None and not re.search(r"^(PASSED|FAILED|ERROR)", text, re.M):
            res.errors += 1
            res.failures.append(
                (
                    f"{rel}",
                    _one_line(text.strip().splitlines()[-1:] and text.strip().splitlines()[-1]),
                )
            )
    if res.timed_out:
        res.failures.append((rel, f"file timed out after {timeout:.0f} s"))
    return res


# ---------------------------------------------------------------------------------------------
# Examples

SYNTHETIC_TORCHVISION = '''"""A stand-in for torchvision's CIFAR-10 (its download is impossible offline): random
3x32x32 images and labels of the same shapes and types, and the two transforms used."""
import torch


class _Compose:
    def __init__(self, fns):
        self.fns = list(fns)

    def __call__(self, x):
        for fn in self.fns:
            x = fn(x)
        return x


class _ToTensor:
    def __call__(self, x):
        return x


class _Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


class transforms:  # noqa: N801
    Compose = _Compose
    ToTensor = _ToTensor
    Normalize = _Normalize


class _CIFAR10(torch.utils.data.Dataset):
    def __init__(self, root, train=True, download=False, transform=None, size=__SIZE__):
        g = torch.Generator().manual_seed(0 if train else 1)
        self.data = torch.rand(size, 3, 32, 32, generator=g)
        self.targets = torch.randint(0, 10, (size,), generator=g).tolist()
        self.transform = transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        x = self.data[i]
        return (self.transform(x) if self.transform else x), self.targets[i]


class datasets:  # noqa: N801
    CIFAR10 = _CIFAR10
'''


def example_substitutions(steps: int) -> Dict[str, List[Tuple[str, str, str]]]:
    """script → [(old, new, why)]; each old must occur exactly once."""
    return {
        "train_ddp.py": [
            (
                "import torchvision\n",
                "import _synthetic_torchvision as torchvision\n",
                "CIFAR-10 is downloaded at run time, impossible offline: a synthetic data set of "
                "the same shape (2048 images)",
            ),
            (
                "import torchvision.transforms as transforms\n",
                "from _synthetic_torchvision import transforms\n",
                "the transforms of the synthetic data set",
            ),
            (
                "target_size = 1_000_000_000",
                "target_size = 4_000_000",
                "the deliberately useless 1 GB embedding shrunk to 4 MB (2 cores, 24 GiB)",
            ),
            (
                "if manager.current_step() >= 10000:",
                f"if manager.current_step() >= {steps}:",
                f"{steps} steps instead of 10000",
            ),
        ],
        "train_diloco.py": [
            (
                "target_size = 500 * (1 << 20)",
                "target_size = 4 * (1 << 20)",
                "the deliberately useless 500 MB embeddings shrunk to 4 MB each",
            ),
            (
                "if manager.current_step() >= 15:",
                f"if manager.current_step() >= {max(2, steps // 10)}:",
                f"{max(2, steps // 10)} outer steps (syncs every 20 inner steps) instead of 15",
            ),
        ],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ExampleResult:
    script: str
    ok: bool
    seconds: float
    detail: str
    returncodes: List[Optional[int]] = field(default_factory=list)
    substitutions: List[str] = field(default_factory=list)
    rewrites: Dict[str, List[str]] = field(default_factory=dict)


def run_example(
    src: Path, work: Path, deps: Path, script: str, steps: int, timeout: float
) -> ExampleResult:
    subs = example_substitutions(steps)[script]
    text, rw = rewrite_source((src / script).read_text())
    for old, new, _ in subs:
        if text.count(old) != 1:
            raise RuntimeError(f"{script}: {old!r} occurs {text.count(old)} times, not once")
        text = text.replace(old, new)
    run_dir = work / f"example-{Path(script).stem}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / script).write_text(text)
    (run_dir / "_synthetic_torchvision.py").write_text(
        SYNTHETIC_TORCHVISION.replace("__SIZE__", "2048")
    )
    env = _test_env(run_dir, deps)
    env["PYTHONUNBUFFERED"] = "1"
    res = ExampleResult(
        script, False, 0.0, "", substitutions=[why for _, _, why in subs], rewrites=rw.as_dict()
    )
    t0 = time.monotonic()
    lighthouse = start_lighthouse_process(
        2,
        join_timeout_ms=10000,
        cwd=run_dir,
        env=env,
        log_path=run_dir / "lighthouse.log",
        new_session=True,
    )
    addr = lighthouse.address
    procs: List[subprocess.Popen] = []
    logs = []
    try:
        for group in range(2):
            genv = dict(env)
            genv.update(
                TORCHFT_LIGHTHOUSE=addr if "://" in addr else f"http://{addr}",
                REPLICA_GROUP_ID=str(group),
                NUM_REPLICA_GROUPS="2",
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="1",
                LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()),
                CUDA_VISIBLE_DEVICES="",
            )
            log = open(run_dir / f"group{group}.log", "w+b")
            logs.append(log)
            procs.append(_start_in_session([sys.executable, script], run_dir, genv, log))
        end = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        res.returncodes = [p.poll() for p in procs]
    finally:
        for p in procs:
            _kill_group(p)
        lighthouse.stop()
    res.seconds = time.monotonic() - t0
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read().decode(errors="replace"))
        log.close()
    steps_seen = [max((int(s) for s in re.findall(r"step[= ](\d+)", o)), default=-1) for o in outs]
    together = all(re.search(r"participants=2\b", o) for o in outs)
    if all(rc == 0 for rc in res.returncodes) and together:
        res.ok = True
        res.detail = (
            f"both groups exited 0 after quorums of both; last step logged per group: {steps_seen}"
        )
    else:
        tails = [_one_line("\n".join(o.strip().splitlines()[-1:])) for o in outs]
        res.detail = f"exit codes {res.returncodes} (None: killed at the deadline); tails: {tails}"
    return res


# ---------------------------------------------------------------------------------------------


def print_results(results: List[FileResult], rewrites: Dict[str, Rewrites]) -> None:
    w = max([len(r.file) for r in results] + [4])
    print(f"\n{'file':<{w}}  passed  failed  errors  skipped  seconds  imports")
    tot = [0, 0, 0, 0]
    for r in results:
        rw = rewrites.get(r.file, Rewrites())
        how = rw.describe()
        flag = " (timed out)" if r.timed_out else ""
        print(
            f"{r.file:<{w}}  {r.passed:>6}  {r.failed:>6}  {r.errors:>6}  {r.skipped:>7}  "
            f"{r.seconds:>7.1f}  {how}{flag}"
        )
        for i, v in enumerate((r.passed, r.failed, r.errors, r.skipped)):
            tot[i] += v
    print(f"{'total':<{w}}  {tot[0]:>6}  {tot[1]:>6}  {tot[2]:>6}  {tot[3]:>7}")
    private = {
        f: rw
        for f, rw in rewrites.items()
        if f in {r.file for r in results} and (rw.private_modules or rw.private_names)
    }
    if private:
        print("\nprivate torchft paths mapped, or private names imported:")
        for f, rw in sorted(private.items()):
            print(f"  {f}: {', '.join(sorted(rw.private_modules | rw.private_names))}")
    failing = [(t, why) for r in results for t, why in r.failures]
    if failing:
        print("\nfailing tests:")
        for t, why in failing:
            known = known_failure(t)
            print(f"  {t}\n      {'[known: ' + known + '] ' if known else ''}{why}")


def unexpected_failures(results: List[FileResult]) -> List[str]:
    return [t for r in results for t, _ in r.failures if not known_failure(t)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--release", choices=sorted(RELEASES), default="0.2.0", help="whose tests (default 0.2.0)"
    )
    ap.add_argument("--files", nargs="*", help="test files relative to torchft/ (default: all)")
    ap.add_argument("--examples", action="store_true", help="also run train_ddp/train_diloco")
    ap.add_argument("--no-tests", action="store_true", help="run no test file")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per test file")
    ap.add_argument("--example-steps", type=int, default=20)
    ap.add_argument("--example-timeout", type=float, default=420.0)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args(argv)
    release = RELEASES[args.release]
    if args.examples and release.is_wheel:
        raise SystemExit(f"torchft {release.version}'s wheel holds no example scripts")
    use_release(release)

    sdist = fetch_sdist(args.cache, release=release)
    src = extract_sdist(sdist, args.cache, release)
    deps = install_requirements(args.cache)
    work = Path(tempfile.mkdtemp(prefix="ft-torchft-suite-"))
    report: dict = {"torchft": release.version, "files": {}, "examples": {}}
    status = 0
    try:
        rewrites = prepare_suite(src, work)
        files = [] if args.no_tests else (args.files or test_files(src))
        results = []
        for rel in files:
            if rel not in rewrites:
                raise SystemExit(f"no such test file in torchft {release.version}: {rel}")
            print(f"running {rel} ...", flush=True)
            r = run_file(rel, work, deps, args.timeout)
            results.append(r)
            report["files"][rel] = {
                "passed": r.passed,
                "failed": r.failed,
                "errors": r.errors,
                "skipped": r.skipped,
                "seconds": round(r.seconds, 1),
                "timed_out": r.timed_out,
                "failures": [
                    {"test": t, "reason": why, "known": known_failure(t)} for t, why in r.failures
                ],
                "skips": [{"test": t, "reason": why} for t, why in r.skips],
                "rewrites": rewrites[rel].as_dict(),
            }
        if results:
            print_results(results, rewrites)
            if unexpected_failures(results) or any(r.timed_out for r in results):
                status = 1
        if args.examples:
            for script in ("train_ddp.py", "train_diloco.py"):
                print(
                    f"\nrunning {script} (2 groups, 1 process each, ft lighthouse) ...", flush=True
                )
                ex = run_example(src, work, deps, script, args.example_steps, args.example_timeout)
                print(f"  substituted at run time: {'; '.join(ex.substitutions)}")
                print(f"  {'OK' if ex.ok else 'FAILED'} in {ex.seconds:.0f} s: {ex.detail}")
                report["examples"][script] = vars(ex)
                status |= 0 if ex.ok else 1
    finally:
        if args.json:
            args.json.write_text(json.dumps(report, indent=1, default=str))
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
