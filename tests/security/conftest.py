"""Fixtures of the security tests: the coordination tests' real servers and reaped children."""

from tests.coordination.conftest import (  # noqa: F401  (fixtures, re-exported)
    TRANSPORTS,
    children,
    lighthouse_factory,
    manager_factory,
)
