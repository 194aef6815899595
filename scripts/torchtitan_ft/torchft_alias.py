"""Make ``import torchft`` / ``import torchft.X`` resolve to ``ft`` / ``ft.X`` (same module objects).

For running unmodified torchft users (here: torchtitan 0.3.0's ``experiments/torchft``) against ft
without editing them. Activate by importing this module before the user's code, e.g. from a ``.pth``
file holding the line ``import torchft_alias`` (what ``run.sh`` beside this file does), or with
``python -c "import torchft_alias, runpy; runpy.run_module(...)"``.

``torchft.X`` is the very module object ``ft.X`` (no second copy): ``sys.modules["torchft.X"] is
sys.modules["ft.X"]``. A name that ft lacks fails exactly as a missing torchft module would
(``ModuleNotFoundError: No module named 'torchft.X'``), with ft's name in the note.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

ALIAS, TARGET = "torchft", "ft"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):  # noqa: D401 - importlib protocol
        module = importlib.import_module(self.target)
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # Already executed as ``ft.*``; importlib has just stamped the alias spec on it: put
        # ft's own back (relative imports, pickling and ``importlib.reload`` read it).
        module.__spec__ = self._real_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real = TARGET + fullname[len(ALIAS) :]
        try:
            real_spec = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            real_spec = None
        if real_spec is None:
            return None  # -> ModuleNotFoundError: No module named 'torchft.X'
        return importlib.machinery.ModuleSpec(
            fullname,
            _AliasLoader(real),
            is_package=real_spec.submodule_search_locations is not None,
        )


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())
