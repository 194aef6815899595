#!/usr/bin/env python3
"""ft's requirements as setup.py declares them, read without running setup.py (which needs
torch already installed).

Usage::

    python tools/requirements.py                       # install_requires, one per line
    python tools/requirements.py --extra test --without torch
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path
from typing import List, Sequence

SETUP_PY = Path(__file__).resolve().parent.parent / "setup.py"


def requirements(extras: Sequence[str] = (), setup_py: Path = SETUP_PY) -> List[str]:
    """install_requires, then the requirements of each extra in ``extras``."""
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup":
            kwargs = {kw.arg: kw.value for kw in node.keywords}
            reqs = [ast.literal_eval(e) for e in kwargs["install_requires"].elts]
            declared = ast.literal_eval(kwargs["extras_require"]) if extras else {}
            for extra in extras:
                reqs += declared[extra]
            return reqs
    raise RuntimeError(f"{setup_py} has no setup() call")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", action="append", default=[], help="add an extra's requirements")
    parser.add_argument("--without", action="append", default=[], help="drop this project")
    args = parser.parse_args(argv)
    for req in requirements(args.extra):
        if re.match(r"[A-Za-z0-9_.-]+", req).group(0) not in args.without:
            print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main())
