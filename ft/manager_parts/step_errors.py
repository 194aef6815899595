"""A step's errors: the first one reported, where in the step it arose, and whether it aborted
the process group; and ExceptionWithTraceback, torchft's type for what ``Manager.errored()``
returns (``ft.manager`` re-exports it under torchft's path).

Contract (StepErrors):
  * ``report(e, abort, phase)`` keeps the first error of the step (later ones are usually
    its consequences: collectives refused after the abort it caused) as an
    ExceptionWithTraceback, logs it once, and with ``abort`` aborts the process group, after
    which the step's later allreduces are no-ops. Reporting never raises.
  * ``clear()`` starts the next step with no error.
"""

from __future__ import annotations

import logging
import pickle
import threading
import traceback
from typing import Any, Callable, Dict, Optional

__all__ = ["ExceptionWithTraceback", "StepErrors"]

logger = logging.getLogger("ft.manager")


class ExceptionWithTraceback(Exception):
    """What :meth:`Manager.errored` returns: the reported exception with its traceback as text.

    ``original_exception`` is the exception reported; ``stack_trace`` its formatted
    traceback (captured when it was reported, so it survives the frames it names);
    ``str()`` is ``f"{original}\\n{stack_trace}"``, as in torchft.

    ft addition: the object is also an instance of the original exception's type (it is built
    as a subclass of both, named ``ExceptionWithTraceback[<type>]``), so code that tests
    ``isinstance(manager.errored(), TimeoutError)`` keeps working; the original's instance
    attributes are copied onto it. Where such a subclass cannot exist (a type that cannot be
    subclassed, or whose memory layout clashes) it is a plain ExceptionWithTraceback. It
    pickles as the original exception plus the trace (an original that cannot be
    unpickled travels as a RuntimeError naming its type and message).
    """

    def __new__(cls, e: BaseException, *args: Any, **kwargs: Any) -> "ExceptionWithTraceback":
        if cls is ExceptionWithTraceback and isinstance(e, BaseException):
            made = _traceback_type_for(type(e))
            if made is not ExceptionWithTraceback:
                # With several built-in bases (RuntimeError and OSError, as the checkpoint
                # errors have) only the base that owns the instance layout may allocate it,
                # and it is not always the first: try each in order.
                for base in made.__mro__[2:]:
                    if "__new__" in vars(base):
                        try:
                            return base.__new__(made)
                        except TypeError:
                            continue
                with _traceback_types_lock:  # no base can: plain from now on, for this type
                    _traceback_types[type(e)] = ExceptionWithTraceback
        return super().__new__(cls)

    def __init__(self, e: BaseException) -> None:
        self.original_exception = e
        if e.__traceback__ is not None:
            lines = traceback.format_exception(type(e), e, e.__traceback__)
        else:  # never raised: no frames, just the type and message
            lines = traceback.format_exception_only(type(e), e)
        self.stack_trace: str = "".join(lines)
        # Instance attributes of the original (an HTTP error's ``code``, say), for handlers
        # that read them; the two set above keep their values.
        for key, value in getattr(e, "__dict__", {}).items():
            self.__dict__.setdefault(key, value)
        # BaseException's own __init__: the original type's may require other arguments.
        BaseException.__init__(self, f"{e}\n{self.stack_trace}")

    def __str__(self) -> str:
        # The original type's __str__ may read fields this object never set.
        return str(self.args[0]) if self.args else ""

    def __repr__(self) -> str:
        return f"ExceptionWithTraceback({self.original_exception!r})"

    def __reduce__(self) -> Any:
        original = self.original_exception
        try:
            # Some exception types pickle but cannot be unpickled (urllib's HTTPError): find
            # out now, while the sender can still substitute something that loads.
            pickle.loads(pickle.dumps(original))
        except Exception:  # noqa: BLE001
            original = RuntimeError(f"{type(original).__name__}: {original}")
        return (_rebuild_exception_with_traceback, (original, self.stack_trace))


_traceback_types: Dict[type, type] = {}
_traceback_types_lock = threading.Lock()


def _traceback_type_for(original: type) -> type:
    """ExceptionWithTraceback's subclass that is also a subclass of ``original`` (cached)."""
    if issubclass(original, ExceptionWithTraceback):
        return ExceptionWithTraceback
    with _traceback_types_lock:
        made = _traceback_types.get(original)
        if made is None:
            try:
                made = type(
                    f"ExceptionWithTraceback[{original.__qualname__}]",
                    (ExceptionWithTraceback, original),
                    {"__module__": __name__},
                )
            except TypeError:  # final type or layout conflict
                made = ExceptionWithTraceback
            _traceback_types[original] = made
        return made


def _rebuild_exception_with_traceback(original: BaseException, stack_trace: str) -> Any:
    out = ExceptionWithTraceback(original)
    out.stack_trace = stack_trace
    out.args = (f"{original}\n{stack_trace}",)
    return out


class StepErrors:
    """The current step's first error and whether it aborted the group (module docstring)."""

    def __init__(
        self, abort_group: Callable[[], None], on_first: Callable[[BaseException], None]
    ) -> None:
        """``abort_group``: aborts the process group. ``on_first``: called with the first
        error of a step (the Manager logs it)."""
        self._abort_group = abort_group
        self._on_first = on_first
        self.first: Optional[ExceptionWithTraceback] = None
        # where in the step the first error arose (ft.manager_parts.step_failures.PHASES)
        self.phase = "user"
        # this step's error aborted the process group: its later allreduces are no-ops
        self.aborted = False

    def report(self, e: BaseException, abort: bool, phase: str = "user") -> None:
        if self.first is None:
            self.phase = phase
            # torchft's type, which also keeps the original's type (see ExceptionWithTraceback)
            try:
                self.first = (
                    e if isinstance(e, ExceptionWithTraceback) else ExceptionWithTraceback(e)
                )
            except Exception:  # noqa: BLE001  (reporting an error must never raise)
                self.first = ExceptionWithTraceback(RuntimeError(f"{type(e).__name__}: {e}"))
            self._on_first(e)
        if abort:
            self.aborted = True
            try:
                self._abort_group()
            except Exception:  # noqa: BLE001
                logger.debug("pg.abort() after an error failed", exc_info=True)

    def clear(self) -> None:
        self.first = None
        self.phase = "user"
        self.aborted = False
