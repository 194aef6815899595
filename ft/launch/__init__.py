"""``ft-launch``: a local supervisor for trying ft and for tests.

It starts a lighthouse, N replica groups of W ranks each (torchrun-style environment), restarts a
group that dies, optionally injects failures (``--chaos kill|stop|allreduce``), shows live progress
per replica group and prints a summary at the end. See :mod:`ft.launch.cli`.

Workers talk back through one-line JSON progress records on stdout (:mod:`ft.launch.worker`), and
honour the launcher's stop request and chaos signals through the same module.

The supervisor's parts: :mod:`~ft.launch.cli` (the command line and the loop),
:mod:`~ft.launch.group` (a group's processes, environment, kills and restart policy),
:mod:`~ft.launch.standby` (warm standbys), :mod:`~ft.launch.progress` (reading progress records),
:mod:`~ft.launch.chaos` (failure injection) and :mod:`~ft.launch.display` (status and summary).
"""

from .worker import (  # noqa: F401
    PROGRESS_PREFIX,
    emit,
    install_chaos_handlers,
    parse_progress,
    stop_requested,
    take_injected_allreduce_failure,
)

__all__ = [
    "PROGRESS_PREFIX",
    "emit",
    "install_chaos_handlers",
    "parse_progress",
    "stop_requested",
    "take_injected_allreduce_failure",
]
