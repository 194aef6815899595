"""The state a heal carries: the functions registered under keys, and the lock between the
training thread, which changes that state, and a heal source's transport, which reads it.

Contract:
  * ``register(key, load, save)`` once per key (a second registration of a key is a
    ValueError naming it).
  * ``read()`` calls every ``save`` function under the read lock, so it waits while the
    training thread holds the state (``disallow_reads`` .. ``allow_reads``, which nest: a
    second disallow before an allow is a no-op, as in torchft).
  * ``load(user)`` calls every ``load`` function with its key's entry under the write lock;
    a missing key is a KeyError before anything is loaded.
  * ``load_fns`` is what a received checkpoint is checked against before it is applied
    (ft.manager_parts.heal.check_checkpoint).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping

from ft.checkpointing import RWLock

__all__ = ["RegisteredState"]


class RegisteredState:
    """The registered state-dict functions and their lock (module docstring)."""

    def __init__(self, lock_timeout_s: float) -> None:
        self._save_fns: Dict[str, Callable[[], Any]] = {}
        self._load_fns: Dict[str, Callable[[Any], None]] = {}
        # public: torchft's tests read the Manager's lock and replace it (Manager's
        # _state_dict_lock)
        self.lock = RWLock(timeout=lock_timeout_s)
        self._reads_allowed = True

    @property
    def reads_allowed(self) -> bool:
        return self._reads_allowed

    @property
    def load_fns(self) -> Mapping[str, Callable[[Any], None]]:
        return self._load_fns

    def register(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        if key in self._load_fns:
            raise ValueError(f"a state dict is already registered under {key!r}")
        self._load_fns[key] = load
        self._save_fns[key] = save

    def allow_reads(self) -> None:
        if self._reads_allowed:
            return
        self._reads_allowed = True
        self.lock.w_release()

    def disallow_reads(self) -> None:
        if not self._reads_allowed:
            return
        self.lock.w_acquire()
        self._reads_allowed = False

    def read(self) -> Dict[str, Any]:
        """Every registered state, by key, read under the read lock."""
        with self.lock.r_lock():
            return {key: fn() for key, fn in self._save_fns.items()}

    def load(self, user: Mapping[str, Any]) -> None:
        """Loads ``user[key]`` into every registered key, under the write lock."""
        missing = [key for key in self._load_fns if key not in user]
        if missing:
            raise KeyError(f"the state to load has no entry for the registered keys {missing}")
        with self.lock.w_lock():
            for key, fn in self._load_fns.items():
                fn(user[key])
