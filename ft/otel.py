"""torchft's import path ``torchft.otel``: :func:`setup_logger` and :func:`shutdown` of
:mod:`ft.observability.otel`, where ft keeps them."""

from ft.observability.otel import setup_logger, shutdown  # noqa: F401

__all__ = ["setup_logger", "shutdown"]
