#!/usr/bin/env python3
"""Regenerate the Python gRPC stubs of ``proto/torchft.proto``.

Usage::

    python tools/gen_proto.py                 # writes ft/coordination/_proto/
    python tools/gen_proto.py --out DIR       # writes somewhere else (used by the drift test)
    python tools/gen_proto.py --check         # exit 1 if the checked-in stubs are stale

The output is deterministic and the script is idempotent: files are rewritten only when their
content changes. The generated ``*_pb2_grpc.py`` imports its sibling with a relative import so
the stubs work as a package (``ft.coordination._proto``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
DEFAULT_OUT = ROOT / "ft" / "coordination" / "_proto"
PROTOS = ("torchft.proto",)

_INIT = '"""Generated from proto/ by tools/gen_proto.py. Do not edit."""\n'


def _fix_imports(text: str) -> str:
    # protoc emits ``import torchft_pb2 as torchft__pb2``; make it package-relative.
    return re.sub(r"^import (\w+_pb2) as (\w+)$", r"from . import \1 as \2", text, flags=re.M)


_GATE_NOTE = (
    "# Version gate removed by tools/gen_proto.py: ft supports the floors in pyproject.toml's\n"
    "# dependencies, tested by tests/coordination/test_proto_compat.py.\n"
)


def _drop_version_gates(text: str) -> str:
    """Removes the generated code's refusal of any grpcio/protobuf older than the generator.

    Why: protoc and grpcio-tools stamp their own version as the minimum, so stubs built with
    today's tools would refuse (at ``import ft``) the grpcio 1.84 that ships on our own GPU
    image. What the stubs really call works from grpcio 1.64 (``_registered_method``,
    ``add_registered_method_handlers``) and protobuf 4.25 (``builder``), and
    test_proto_compat.py runs them on exactly those versions.
    """
    protobuf_gate = re.compile(
        r"^from google\.protobuf import runtime_version as _runtime_version\n", re.M
    )
    protobuf_call = re.compile(
        r"^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:.*\n)*?\)\n", re.M
    )
    grpc_gate = re.compile(
        r"^GRPC_GENERATED_VERSION = .*?\n(?:.*\n)*?^if _version_not_supported:\n(?:    .*\n)+", re.M
    )
    out = protobuf_gate.sub("", text)
    out = protobuf_call.sub(_GATE_NOTE, out)
    out = grpc_gate.sub(_GATE_NOTE, out)
    if any(
        k in out
        for k in (
            "runtime_version",
            "ValidateProtobufRuntimeVersion",
            "GRPC_GENERATED_VERSION",
            "_version_not_supported",
        )
    ):
        raise RuntimeError(
            "gen_proto: the generated version gate changed shape; update _drop_version_gates"
        )
    return out


def generate(out_dir: Optional[Path] = None) -> Dict[str, str]:
    """Generates the stubs and returns {file name: content} (does not write to the package)."""
    from grpc_tools import protoc  # imported lazily: only needed at build time

    import grpc_tools

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory(prefix="ft_gen_proto_") as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--pyi_out={tmp}",
            *[str(PROTO_DIR / p) for p in PROTOS],
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        files = {"__init__.py": _INIT}
        for path in sorted(Path(tmp).iterdir()):
            if path.suffix in (".py", ".pyi"):
                files[path.name] = _drop_version_gates(_fix_imports(path.read_text()))
    if out_dir is not None:
        write(files, out_dir)
    return files


def write(files: Dict[str, str], out_dir: Path) -> bool:
    """Writes files whose content differs; returns True if anything changed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    changed = False
    for name, content in files.items():
        dst = out_dir / name
        if dst.exists() and dst.read_text() == content:
            continue
        tmp = dst.with_suffix(dst.suffix + ".tmp")
        tmp.write_text(content)
        os.replace(tmp, dst)
        changed = True
    return changed


def stale_files(out_dir: Path = DEFAULT_OUT) -> Sequence[str]:
    """Names of stubs in out_dir that differ from freshly generated ones."""
    fresh = generate()
    stale = []
    for name, content in fresh.items():
        dst = out_dir / name
        if not dst.exists() or dst.read_text() != content:
            stale.append(name)
    return stale


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--check", action="store_true", help="only check for drift")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.out)
        if stale:
            print(f"stale generated stubs in {args.out}: {', '.join(stale)}", file=sys.stderr)
            print("run: python tools/gen_proto.py", file=sys.stderr)
            return 1
        return 0
    changed = write(generate(), args.out)
    print(f"{'wrote' if changed else 'up to date:'} {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
