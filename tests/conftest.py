"""Fixtures for the whole suite, and how a test finds what it imports.

``import ft`` and ``import tests.x``: ``tests`` and its directories are packages
(``__init__.py``; tests/checkpointing is not yet), so pytest (its default "prepend" import
mode) puts the directory above ``tests``, the repository root, first on ``sys.path`` before it
imports this file. ``ft`` is then the source tree's, with the extensions that
``python setup.py build_ext --inplace`` builds beside it. A directory's conftest.py is
``tests.<dir>.conftest`` and holds fixtures, nothing a test imports: helpers live in ordinary
modules (``tests.procs``, ``tests.coordination._helpers``), so several directories run in one
pytest call. Children of a test start in the repository root with it first on ``PYTHONPATH``
(tests/procs.py, ``child_env``) and run this repository's modules as ``python -m tests.x``.

Child processes: tests/procs.py is the one harness (``Proc``, ``Procs``, ``Workers``,
``Replicas``); the fixtures below hand its objects to a test and kill and reap them after it,
whatever the test did.
"""

from contextlib import ExitStack

import pytest

from tests.procs import Procs, Replicas, kill_leftovers


@pytest.fixture
def procs():
    """``procs(argv, **Proc kwargs)`` or ``procs.python(module, *args)`` starts a child
    (tests.procs.Proc); ``procs.add(proc)`` adopts one. Every one is killed by its pid and
    reaped after the test."""
    with Procs() as group:
        yield group


@pytest.fixture
def replicas():
    """A lighthouse plus N replica processes: ``replicas(target, n, lighthouse={...},
    **worker_kwargs)`` returns a started tests.procs.Replicas (``.lh``, ``.store``,
    ``.join``, ``.spawn``, ``.by_rank``); after the test its children are killed and reaped
    and its lighthouse shut down."""
    with ExitStack() as stack:
        yield lambda *args, **kw: stack.enter_context(Replicas(*args, **kw))


def pytest_sessionfinish(session, exitstatus):
    kill_leftovers()  # children a test started outside these fixtures and never reaped
