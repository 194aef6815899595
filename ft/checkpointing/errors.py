"""The errors of a checkpoint transfer: one base class and what went wrong.

Every transport raises these, so that a Manager can treat any of them as a failed heal, and
code written against torchft's HTTP transport (which fetches with ``urlopen``) still catches
a refusal or a broken connection as the ``urllib`` error it expects.
"""

from __future__ import annotations

import urllib.error

__all__ = [
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointNotAvailableError",
    "CheckpointTransferError",
    "CheckpointAuthError",
    "CheckpointFormatError",
]


class CheckpointError(RuntimeError):
    """Base class of every failure of a checkpoint transfer.

    A Manager treats any of these as a failed heal: nothing received is loaded.
    """


class CheckpointCorruptError(CheckpointError):
    """The bytes that arrived do not match the checksum the sender computed."""


class CheckpointNotAvailableError(CheckpointError, urllib.error.HTTPError):
    """The source does not (or no longer) serve the requested step.

    Also a :class:`urllib.error.HTTPError` (so an :class:`OSError`): code that catches what
    torchft's HTTP transport raises for a refused request (it fetches with ``urlopen``) catches
    this too. ``code`` is the HTTP status of the refusal (404 when not from HTTP).
    """

    def __init__(self, message: str = "", code: int = 404, url: str = "") -> None:
        urllib.error.HTTPError.__init__(self, url, code, message, None, None)
        self.args = (message,)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class CheckpointTransferError(CheckpointError, urllib.error.URLError):
    """The peer vanished, the connection broke, or the transfer ran past its timeout.

    Also a :class:`urllib.error.URLError` (so an :class:`OSError`): code that catches what
    torchft's HTTP transport raises when its ``urlopen`` fails catches this too.
    """

    def __init__(self, message: str = "") -> None:
        urllib.error.URLError.__init__(self, message)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class CheckpointAuthError(CheckpointError):
    """The source refused the request's token (HTTP 403)."""


class CheckpointFormatError(CheckpointError):
    """The peer sent metadata that is not a valid ft checkpoint description."""
