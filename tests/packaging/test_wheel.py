"""The wheel scripts/build_wheel.sh makes carries the native gRPC server with gRPC C++ bundled,
and serves on it where no gRPC C++ is installed.

The wheel is conftest.py's ``built_wheel`` (the script run on the sdist: the compile this test
shares with test_sdist.py), installed by the script into a fresh venv with its dependencies.
This machine has gRPC C++ installed, so "where none is installed" is shown two ways:

* what the processes map: importing ``ft.coordination._grpc_server`` maps only the module and
  libraries from the wheel's own ``ft_torch.libs/`` folder, and after a quorum neither the
  lighthouse nor the ManagerServer process has any gRPC C++ library mapped from elsewhere;
* the same quorum with the system's gRPC C++ libraries made unloadable: each process runs in
  a mount namespace of its own (``unshare --mount``) in which /dev/null is bind-mounted over
  every file of gRPC C++ and the libraries only it uses (abseil, c-ares, re2, upb,
  address_sorting), as ``ldconfig -p`` lists them; loading one of them there fails (checked),
  so a process that still serves could not have used them. Needs root (or user namespaces);
  skips where ``unshare --mount`` is refused.

The lighthouse is the wheel's ``ft-lighthouse`` entry point, in its own process; the group is
``wheel_quorum.py`` (a ManagerServer and a ManagerClient, default transports). Both must log
that they serve on the native server.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import zipfile
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

from tests.packaging import _util
from tests.procs import Proc, lighthouse_argv

# gRPC C++ and the libraries only it uses, by file name (Debian's libgrpc++-dev and its
# dependencies; OpenSSL, zlib and the C/C++ runtime are shared with Python itself).
GRPC_LIB = re.compile(r"^lib(grpc|gpr|upb|absl_|cares|re2|address_sorting)")


def libs_dir(venv: Path) -> Path:
    return _util.venv_site_packages(venv) / "ft_torch.libs"


def foreign_grpc_libs(paths: Sequence[str], venv: Path) -> List[str]:
    """The gRPC C++ libraries among ``paths`` that are not the wheel's own."""
    own = str(libs_dir(venv)) + os.sep
    return [p for p in paths if GRPC_LIB.match(os.path.basename(p)) and not p.startswith(own)]


def process_maps(pid: int) -> List[str]:
    with open(f"/proc/{pid}/maps") as f:
        return sorted(
            {
                fields[5].strip()
                for fields in (line.split(None, 5) for line in f)
                if len(fields) == 6
            }
        )


def system_grpc_files() -> Dict[str, str]:
    """soname -> real file, of every gRPC C++ library the dynamic loader's cache lists."""
    out = {}
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True)
    for line in listing.stdout.splitlines()[1:]:
        name, _, path = line.strip().partition(" => ")
        soname = name.split()[0]
        if GRPC_LIB.match(soname) and os.path.exists(path):
            out[soname] = os.path.realpath(path)
    return out


@pytest.fixture(scope="module")
def wheel(built_wheel):
    if not built_wheel.native:
        pytest.skip("no gRPC C++ on this machine (pkg-config grpc++ libcrypto): no native server")
    return built_wheel


def test_the_wheel_holds_the_native_server_and_bundles_grpc(wheel):
    names = zipfile.ZipFile(wheel.wheel).namelist()
    assert [n for n in names if re.fullmatch(r"ft/coordination/_grpc_server\..*\.so", n)], names
    bundled = [n.split("/", 1)[1] for n in names if n.startswith("ft_torch.libs/")]
    bundled = [n for n in bundled if n]
    assert any(n.startswith("libgrpc++") for n in bundled), bundled
    assert not [n for n in names if re.search(r"libtorch|libc10", n)]
    size = wheel.wheel.stat().st_size
    print(f"{wheel.wheel.name}: {size} bytes ({size / 2**20:.1f} MiB); bundled: {bundled}")
    assert "native gRPC server: true" in wheel.output


def serve_a_quorum(wheel, tmp_path: Path, wrap: Sequence[str] = (), must_fail: Sequence[str] = ()):
    """The wheel's lighthouse and a group (wheel_quorum.py), each started as ``wrap + argv``,
    from a folder outside the tree and without LD_LIBRARY_PATH; a quorum between them. Returns
    (the group's report, the lighthouse's mapped files). ``must_fail``: libraries the group
    tries to load first (wheel_quorum.py)."""
    venv = wheel.check_venv
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    script = shutil.copy(_util.HERE / "wheel_quorum.py", outside / "wheel_quorum.py")
    env = _util.clean_env()
    env.pop("LD_LIBRARY_PATH", None)
    for name in ("FT_LIGHTHOUSE_TRANSPORT", "FT_CLIENT_TRANSPORT"):
        env.pop(name, None)
    lighthouse = lighthouse_argv(venv / "bin" / "ft-lighthouse", join_timeout_ms=100)
    with Proc(
        [*wrap, *lighthouse], cwd=outside, env=env, source_tree=False, name="wheel ft-lighthouse"
    ) as lh:
        ready = lh.wait_for_line(r"^ft-lighthouse ready grpc=", 60)
        addr = ready.split("grpc=")[1].split()[0]
        group = _util.run(
            [*wrap, _util.venv_python(venv), script, addr, *must_fail],
            cwd=outside,
            env=env,
            timeout=180,
        )
        lh_maps = process_maps(lh.pid)
        lh.signal(signal.SIGTERM)
        assert lh.wait(15) == 0, lh.output()
    report = json.loads(group.stdout.strip().splitlines()[-1])
    assert report["replica_world_size"] == 1 and report["replica_rank"] == 0, report
    serving = [line for line in lh.lines if "lighthouse serving gRPC" in line]
    assert len(serving) == 1 and "(native server)" in serving[0], lh.output()
    ms_lines = [line for line in group.stderr.splitlines() if "manager server" in line]
    assert any("(native server," in line for line in ms_lines), group.stderr[-3000:]
    return report, lh_maps


def test_the_wheel_loads_grpc_from_its_own_libs(wheel, tmp_path):
    venv = wheel.check_venv
    own = str(libs_dir(venv)) + os.sep
    (module,) = (_util.venv_site_packages(venv) / "ft" / "coordination").glob("_grpc_server.*.so")
    # What the dynamic loader resolves the module's dependencies to (its RUNPATH points at the
    # wheel's libs): every gRPC C++ library from there, nothing unresolved.
    ldd = _util.run(["ldd", module], timeout=60, env=_util.clean_env()).stdout
    resolved = {
        line.split(" => ")[0].strip(): os.path.normpath(line.split(" => ")[1].split(" (")[0])
        for line in ldd.splitlines()
        if " => " in line
    }
    assert "not found" not in ldd, ldd
    grpc_deps = {name: path for name, path in resolved.items() if GRPC_LIB.match(name)}
    assert any(name.startswith("libgrpc++") for name in grpc_deps), ldd
    assert all(path.startswith(own) for path in grpc_deps.values()), ldd

    # What the processes map: importing the module maps libgrpc++ from the wheel; after a
    # quorum neither process has a gRPC C++ library from anywhere else.
    report, lh_maps = serve_a_quorum(wheel, tmp_path)
    assert report["module"] == str(module)
    by_import = report["mapped_by_import"]
    assert str(module) in by_import, by_import
    assert any(p.startswith(own + "libgrpc++") for p in by_import), by_import
    assert not foreign_grpc_libs(by_import, venv), by_import
    assert not foreign_grpc_libs(report["mapped_at_end"], venv), report["mapped_at_end"]
    assert not foreign_grpc_libs(lh_maps, venv), lh_maps
    assert any(p.startswith(own + "libgrpc++") for p in lh_maps), lh_maps


def test_the_wheel_serves_a_quorum_with_the_system_grpc_hidden(wheel, tmp_path):
    hidden = system_grpc_files()
    grpcpp = [s for s in hidden if s.startswith("libgrpc++.so")]
    assert grpcpp, f"ldconfig lists no libgrpc++ although pkg-config finds it: {hidden}"
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount refused here: {probe.stderr.strip()}")
    hide = tmp_path / "hide.sh"
    hide.write_text(
        'set -e\nwhile [ "$1" != -- ]; do mount --bind /dev/null "$1"; shift; done\n'
        'shift\nexec "$@"\n'
    )
    wrap = ["unshare", "--mount", "--propagation", "private", "sh", hide]
    wrap += sorted(set(hidden.values())) + ["--"]

    # Controls: the system's libgrpc++, and the same module as built, before auditwheel
    # bundled gRPC C++ (it links the system's), must both fail to load there.
    with zipfile.ZipFile(wheel.raw_wheel) as raw:
        (member,) = [n for n in raw.namelist() if "/_grpc_server." in n]
        unbundled = raw.extract(member, tmp_path / "raw")
    report, lh_maps = serve_a_quorum(wheel, tmp_path, wrap=wrap, must_fail=[*grpcpp, unbundled])
    assert set(report["system_loads"]) == {*grpcpp, unbundled}
    for what, result in report["system_loads"].items():
        assert result != "loaded", f"{what} was still loadable in the namespace"
    venv = wheel.check_venv
    assert not foreign_grpc_libs(report["mapped_at_end"], venv)
    assert not foreign_grpc_libs(lh_maps, venv)
