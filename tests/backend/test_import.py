"""``import ft``: the backend "ft" is there after ``import ft`` and ``import torch`` in either
order; ``import ft`` alone loads neither torch nor the extension; a broken extension never
breaks ``import torch``. Each case runs in a fresh interpreter (imports are process-wide)."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# What the interpreter imports before it uses the backend "ft": ``import ft`` and
# ``import torch`` in either order, or a module of ft before torch, with RuntimeWarnings errors
# (torch's first import then happens inside that module's own top level, while the module is
# half-initialised: torchft's tests start with `from torchft.work import ...`).
FIRST = {
    "ft, torch": "import ft\nimport torch",
    "torch, ft": "import torch\nimport ft",
    "torch.distributed, ft": "import torch.distributed\nimport ft",
    **{
        m: f"import warnings\nwarnings.simplefilter('error', RuntimeWarning)\nimport {m}"
        for m in ["ft.work", "ft.futures", "ft.process_group", "ft.manager"]
    },
}


@pytest.mark.parametrize("first", list(FIRST))
def test_backend_is_registered_whatever_is_imported_first_and_without_a_cycle(first):
    r = run(
        FIRST[first]
        + """
import torch, torch.distributed as dist
assert "ft" in dist.Backend.backend_list, dist.Backend.backend_list
dist.init_process_group("ft", store=dist.HashStore(), rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
dist.destroy_process_group()
print("OK", t.tolist())
"""
    )
    assert r.returncode == 0, r.stderr
    assert "OK [1.0, 1.0, 1.0]" in r.stdout
    assert "could not be registered" not in r.stderr


def test_import_ft_loads_neither_torch_nor_the_extension_until_a_name_needs_them():
    r = run("""
        import sys
        import ft, ft.coordination
        print("before", "torch" in sys.modules, "ft._C" in sys.modules, ft.__version__)
        ft.Manager
        print("after", "torch" in sys.modules, "ft._C" in sys.modules)
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("before False False ")
    assert lines[1] == "after True True"


def test_a_broken_extension_warns_and_leaves_torch_importable():
    r = run("""
        import sys, warnings

        class HideExtension:
            def find_spec(self, name, path=None, target=None):
                if name == "ft._C":
                    raise ModuleNotFoundError("ft._C is hidden", name=name)

        sys.meta_path.insert(0, HideExtension())
        import ft
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch
        print("torch", torch.ones(2).sum().item())
        print("warned", any("could not be registered" in str(w.message) for w in caught))
        try:
            ft.ProcessGroupGloo
        except ImportError as e:
            print("use fails:", e)
    """)
    assert r.returncode == 0, r.stderr
    assert "torch 2.0" in r.stdout
    assert "warned True" in r.stdout
    assert "use fails:" in r.stdout and "_C" in r.stdout.split("use fails:")[1]


def test_unknown_attribute_is_an_attribute_error():
    import ft

    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        ft.NoSuchThing  # noqa: B018 (the lookup itself must raise)
    assert "Manager" in dir(ft) and ft.__version__


@pytest.mark.parametrize("env", [{}, {"FT_NCCL_REVOKE": "0"}], ids=["default", "off"])
def test_busy_nccl_communicators_are_revoked_where_the_linked_nccl_can(env, monkeypatch):
    # Runs in the CUDA build lane (an NCCL build needs no GPU to say what it links).
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    r = run("""
        import torch, ft
        print(repr((ft._C.has_nccl, ft._C.nccl_version(), ft._C.nccl_revoke_available())))
    """)
    assert r.returncode == 0, r.stderr
    has_nccl, version, revoke = eval(r.stdout.strip().splitlines()[-1])
    if not has_nccl:
        assert revoke is False and version is None
        return
    assert revoke == (not env and tuple(version) >= (2, 28, 7)), (version, revoke)
