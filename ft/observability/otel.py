"""OpenTelemetry export of a logger's records (torchft's ``torchft.otel.setup_logger``).

Contract:
* ``setup_logger(name)`` does nothing unless ``TORCHFT_USE_OTEL`` is set to something other
  than ``""``, ``"0"``, ``"false"`` or ``"no"``. When it is, the records of
  ``logging.getLogger(name)`` are exported through OpenTelemetry: printed to the console and
  sent with OTLP over HTTP (the exporter's standard ``OTEL_EXPORTER_OTLP_*`` variables say
  where). Calling it again for the same name does nothing.
* ``TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON`` may name a JSON file mapping logger names to
  resource attributes (``{"ft.manager": {"service.name": "trainer"}}``); a name absent from
  it gets default resource attributes.
* Export enabled without the OpenTelemetry packages raises ImportError naming them.
* No torch import. ``import ft`` calls it for torchft's three record loggers
  (``torchft_quorums``, ``torchft_commits``, ``torchft_errors``: see :mod:`ft.observability.records`), as
  ``import torchft`` does, and warns instead of failing when the packages are missing. ft's
  own loggers (``ft.manager``, ``ft.backend.process_group``, ...) are exported when ``setup_logger``
  is called for them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, Dict

__all__ = ["setup_logger", "shutdown"]

USE_OTEL_ENV = "TORCHFT_USE_OTEL"
RESOURCE_ATTRIBUTES_ENV = "TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON"

_lock = threading.Lock()
_providers: Dict[str, Any] = {}


def _enabled() -> bool:
    return os.environ.get(USE_OTEL_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _resource_attributes(name: str) -> Dict[str, Any]:
    path = os.environ.get(RESOURCE_ATTRIBUTES_ENV)
    if not path:
        return {}
    with open(path) as f:
        table = json.load(f)
    if not isinstance(table, dict):
        raise ValueError(
            f"{RESOURCE_ATTRIBUTES_ENV}={path!r} must hold a JSON object of "
            f"logger name -> attributes"
        )
    return dict(table.get(name, {}))


def setup_logger(name: str) -> None:
    """Exports ``logging.getLogger(name)``'s records through OpenTelemetry when
    ``TORCHFT_USE_OTEL`` is on (see the module doc); otherwise does nothing."""
    if not _enabled():
        return
    try:
        from opentelemetry._logs import set_logger_provider
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
        from opentelemetry.sdk._logs.export import (
            BatchLogRecordProcessor,
            ConsoleLogExporter,
            SimpleLogRecordProcessor,
        )
        from opentelemetry.sdk.resources import Resource
    except ImportError as e:
        raise ImportError(
            f"{USE_OTEL_ENV} is on, but OpenTelemetry is not installed ({e}); install "
            f"opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http, or unset "
            f"{USE_OTEL_ENV}"
        ) from e

    with _lock:
        if name in _providers:
            return
        provider = LoggerProvider(resource=Resource.create(attributes=_resource_attributes(name)))
        set_logger_provider(provider)
        # Two processors rather than one exporter fanning out: each exporter keeps its own
        # batching and failures (a dead collector must not silence the console).
        provider.add_log_record_processor(SimpleLogRecordProcessor(ConsoleLogExporter()))
        provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter(timeout=5)))
        logging.getLogger(name).addHandler(
            LoggingHandler(level=logging.NOTSET, logger_provider=provider)
        )
        _providers[name] = provider


def shutdown() -> None:
    """Flushes and stops every exporter :func:`setup_logger` started."""
    with _lock:
        providers = list(_providers.values())
        _providers.clear()
    for provider in providers:
        provider.shutdown()
