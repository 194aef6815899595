"""Run ``python -m torchtitan.train`` (torchtitan 0.3.0, unmodified) on a CPU-only torch, with
``import torchft`` answered by ft.

Usage: python titan_cpu_launch.py <torchtitan.train arguments...>

What it does before handing over to ``torchtitan.train`` (runpy, as ``__main__``):

1. ``import torchft_alias``: ``torchft`` / ``torchft.X`` resolve to ``ft`` / ``ft.X`` (skipped with
   TITAN_REAL_TORCHFT=1, for a comparison run in a venv that has the real torchft 0.2.0).
2. CPU shims, all for torchtitan's accelerator assumptions (no ft gap among them):
   a. ``torchtitan/tools/utils.py`` line 55,
      ``device_type = _get_available_device_type() or "cuda"``: with no accelerator torchtitan
      picks "cuda" anyway, then ``torch.cuda.set_device`` fails ("Torch not compiled with CUDA
      enabled"). There is no config knob for it, so ``torch._utils._get_available_device_type``
      is made to answer "cpu" when it would answer None (before torchtitan is imported: the
      value is copied into many modules at import time).
   b. torchtitan then uses ``torch.cpu`` as its device module, which lacks the CUDA memory API
      that ``components/metrics.py`` (DeviceMemoryMonitor) calls unconditionally:
      get_device_name, get_device_properties(...).total_memory, reset_peak_memory_stats,
      empty_cache, memory_stats. They are added here as no-op / constant stand-ins.
   c. ``torch.cpu.current_device()`` answers the string "cpu"; torchtitan passes it as
      ``dist.barrier(device_ids=[...])`` (``distributed/utils.py`` set_pg_timeouts after step 1),
      which wants ints. Made to answer 0.
3. torch version gap (not CPU-specific): torchtitan 0.3.0 calls ``torch.distributed.set_timeout``
   (``distributed/utils.py`` set_pg_timeouts, after step 1), which this torch 2.13.0+cpu does not
   have ("AttributeError: module 'torch.distributed' has no attribute 'set_timeout'"); the same
   operation exists as ``torch.distributed.distributed_c10d._set_pg_timeout`` and is aliased.
4. ``TORCHDYNAMO_DISABLE=1`` (set by run.sh, not here): torchtitan's llama3 attention is
   FlexAttention wrapped in ``torch.compile`` (``models/common/attention.py``) and "flex" and the
   CUDA-only "varlen" are the only language-model backends; on CPU inductor would build C++ with
   g++ on every start. With dynamo off, flex_attention runs its eager (unfused) implementation.
"""

from __future__ import annotations

import os
import runpy
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if os.environ.get("TITAN_REAL_TORCHFT") != "1":  # "1": compare against the real torchft
    import torchft_alias  # noqa: E402,F401

import torch  # noqa: E402
import torch._utils  # noqa: E402

if not torch.cuda.is_available():
    _orig = torch._utils._get_available_device_type

    def _device_type_or_cpu():
        return _orig() or "cpu"

    torch._utils._get_available_device_type = _device_type_or_cpu

    cpu = torch.cpu
    try:
        _total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        _total = 1 << 34
    for name, fn in {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: types.SimpleNamespace(
            name="cpu", total_memory=_total
        ),
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
        "memory_stats": lambda *a, **k: {},
    }.items():
        if not hasattr(cpu, name):
            setattr(cpu, name, fn)
    cpu.current_device = lambda: 0

import torch.distributed as _dist  # noqa: E402

if not hasattr(_dist, "set_timeout"):
    from torch.distributed.distributed_c10d import _set_pg_timeout  # noqa: E402

    _dist.set_timeout = _set_pg_timeout

sys.argv = ["torchtitan.train", *sys.argv[1:]]
runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
