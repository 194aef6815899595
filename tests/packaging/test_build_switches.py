"""setup.py's build switches (docs/building.md, "Build switches") decide what it would compile, checked
without compiling: a child runs setup.py up to its setup() call and reports the decisions
under each environment. NCCL lookups use a fake NCCL install (empty files with NCCL's names)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from tests.packaging import _util

PROBE = textwrap.dedent("""
    import json, os, sys
    src = open(sys.argv[1]).read()
    code = compile(src[:src.rindex("setup(")], "setup.py", "exec")  # all but the setup() call
    base_env = dict(os.environ)

    def attempt(fn):
        try:
            return fn()
        except SystemExit as e:
            return "exit: " + str(e)

    results = []
    for commands, env in json.loads(sys.argv[2]):
        os.environ.clear()
        os.environ.update(base_env, **env)
        sys.argv = ["setup.py", *commands]
        ns = {"__name__": "setup_probe", "__file__": os.path.abspath("setup.py")}
        err = attempt(lambda: exec(code, ns))
        if err:
            results.append({"error": err})
            continue
        results.append({"flags": ns["optimization_flags"](), "use_nccl": ns["use_nccl"](),
                        "find_nccl": attempt(ns["find_nccl"]),
                        "ext": sorted(e.name for e in ns["ext_modules"])})
        results[-1]["grpc"] = "ft.coordination._grpc_server" in results[-1]["ext"]
    print(json.dumps(results))
""")


def probe_all(tmp_path, scenarios, grpc=False):
    """[(commands, env)] -> setup.py's decisions in each (one child: torch is imported once).
    Unless ``grpc``, the native gRPC server is switched off: looking for gRPC C++ costs ~2.5 s
    of pkg-config each time."""
    if not grpc:
        scenarios = [(c, {"FT_NATIVE_GRPC": "0", **e}) for c, e in scenarios]
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    r = _util.run(
        [
            sys.executable,
            script,
            _util.ROOT / "setup.py",
            json.dumps([[list(c), e] for c, e in scenarios]),
        ],
        cwd=_util.ROOT,
        env=_util.clean_env(),
        timeout=180,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def fake_nccl(tmp_path):
    home = tmp_path / "nccl"
    for d in ("include", "lib64", "elsewhere"):
        (home / d).mkdir(parents=True)
    (home / "include" / "nccl.h").write_text("")
    (home / "lib64" / "libnccl.so.2").write_text("")
    (home / "elsewhere" / "libnccl.so.2").write_text("")
    return home


def test_defaults_and_debug_flags(tmp_path):
    default, debug, both, relwdi = probe_all(
        tmp_path,
        [
            (("build_ext",), {"DEBUG": "0", "REL_WITH_DEB_INFO": "0"}),
            (("build_ext",), {"DEBUG": "1"}),
            (("build_ext",), {"DEBUG": "ON", "REL_WITH_DEB_INFO": "1"}),
            (("build_ext",), {"REL_WITH_DEB_INFO": "yes"}),
        ],
    )
    assert default["flags"] == ["-O2", "-g0"] and "ft._C" in default["ext"]
    assert debug["flags"] == ["-O0", "-g"] and both["flags"] == ["-O0", "-g"]
    assert relwdi["flags"] == ["-O2", "-g"]


def test_nccl_search_order(tmp_path, fake_nccl):
    home = str(fake_nccl)
    by_home, lib_dir_wins, both_dirs, bad = [
        r["find_nccl"]
        for r in probe_all(
            tmp_path,
            [
                (("build_ext",), {"NCCL_HOME": home}),
                (("build_ext",), {"NCCL_HOME": home, "NCCL_LIB_DIR": f"{home}/elsewhere"}),
                (
                    ("build_ext",),
                    {"NCCL_INCLUDE_DIR": f"{home}/include", "NCCL_LIB_DIR": f"{home}/elsewhere"},
                ),
                (
                    ("build_ext",),
                    {"NCCL_INCLUDE_DIR": f"{home}/include", "NCCL_LIB_DIR": f"{home}/include"},
                ),
            ],
        )
    ]
    assert by_home == [f"{home}/include", f"{home}/lib64"]
    assert lib_dir_wins == both_dirs == [f"{home}/include", f"{home}/elsewhere"]
    assert bad.startswith("exit: ") and "NCCL_LIB_DIR" in bad


def test_nccl_switches(tmp_path):
    import torch

    default, asked, *off = [
        r["use_nccl"]
        for r in probe_all(
            tmp_path,
            [
                (("build_ext",), {}),
                (("build_ext",), {"USE_NCCL": "1"}),
                (("build_ext",), {"USE_NCCL": "0"}),
                (("build_ext",), {"FT_USE_NCCL": "0"}),
                (("build_ext",), {"USE_CUDA": "0"}),
                (("build_ext",), {"USE_NCCL": "OFF"}),
            ],
        )
    ]
    cuda = torch.version.cuda is not None
    # A CPU torch never builds the NCCL path, whatever is asked; a CUDA torch by default.
    assert default is cuda and asked is cuda
    assert off == [False] * 4


def test_native_grpc_switches(tmp_path):
    results = probe_all(
        tmp_path,
        [
            (("build_ext",), {"FT_NATIVE_GRPC": "0"}),
            (("bdist_wheel",), {}),
            (("bdist_wheel",), {"FT_WHEEL_NATIVE_GRPC": "0"}),
            (("build_ext",), {}),
            (("build_ext",), {"FT_NATIVE_GRPC": "1"}),
        ],
        grpc=True,
    )
    off, wheel, wheel_off, in_place, required = [r.get("grpc", r.get("error")) for r in results]
    assert off is False
    assert wheel == in_place  # a wheel too: wherever gRPC C++, libcrypto and pybind11 are found
    assert wheel_off is False  # the wheel's opt-out
    assert required is True or required.startswith("exit: ")
    if in_place:
        assert required is True


def test_a_bad_switch_value_is_an_error(tmp_path):
    (out,) = probe_all(tmp_path, [(("build_ext",), {"DEBUG": "maybe"})])
    assert out["error"].startswith("exit: ") and "DEBUG='maybe'" in out["error"], out
