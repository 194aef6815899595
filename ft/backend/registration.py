"""Registers the torch.distributed backend "ft" as soon as torch is importable-and-imported.

Contract:
* :func:`register_when_torch_loads` is called once, by ``import ft``. If torch is already in
  ``sys.modules`` it imports :mod:`ft.backend.process_group` (which registers the backend) at once.
  Otherwise it arms a one-shot import hook: when the module ``torch`` finishes executing, the
  backend is registered, and the hook removes itself.
* A process that never imports torch (a lighthouse) never loads torch or ``ft._C``.
* When torch is first imported by an ft module's own top level (``import ft.work`` or
  ``from ft.futures import ...`` as a program's first import), :mod:`ft.backend.process_group` cannot
  be imported yet: it imports that half-initialised module. The backend is then registered with
  a creator that imports :mod:`ft.backend.process_group` when ``init_process_group("ft")`` first runs.
* A failure to register (for example an ``ft._C`` built for another torch) never breaks
  ``import torch``: it is logged as a warning, and the same error is raised again, with its
  cause, by the first use of an ft name that needs the backend.

Why a hook and not an eager ``import torch``: ``import ft.coordination`` always runs this
package's ``__init__`` first, and a lighthouse must not pay torch's import (seconds, and
hundreds of MB in its container) for a package that does not use it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Optional, Sequence

_TORCH = "torch"


_BACKEND = "ft"


def _an_ft_module_is_initialising() -> bool:
    for name, module in list(sys.modules.items()):
        if name.startswith("ft.") and getattr(module.__spec__, "_initializing", False):
            return True
    return False


def _create_backend(store, rank: int, world_size: int, timeout):
    from ft.backend.process_group import create_backend as create

    return create(store, rank, world_size, timeout)


def _register() -> None:
    if not _an_ft_module_is_initialising():
        import ft.backend.process_group  # noqa: F401  (registers "ft" with torch.distributed on import)

        return
    import torch.distributed as dist

    if _BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            _BACKEND, _create_backend, extended_api=False, devices=["cpu", "cuda"]
        )


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it lets the other finders find ``torch``, then wraps that one
    loader's ``exec_module`` so that the registration runs right after torch's own code."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ):
        if fullname != _TORCH:
            return None
        _disarm()
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is not None:
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_torch = spec.loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_torch(module)
            try:
                _register()
            except Exception as e:  # noqa: BLE001  (never break the user's `import torch`)
                warnings.warn(
                    f"ft: the torch.distributed backend 'ft' could not be registered: {e!r}",
                    RuntimeWarning,
                    stacklevel=2,
                )

        spec.loader.exec_module = exec_then_register  # this loader object loads only torch
        return spec


_hook: Optional[_AfterTorchImport] = None


def _disarm() -> None:
    global _hook
    if _hook is not None:
        try:
            sys.meta_path.remove(_hook)
        except ValueError:
            pass
        _hook = None


def register_when_torch_loads() -> None:
    global _hook
    if _TORCH in sys.modules:
        _register()
    elif _hook is None:
        _hook = _AfterTorchImport()
        sys.meta_path.insert(0, _hook)
