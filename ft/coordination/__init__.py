"""ft's control plane: the lighthouse, the per-group ManagerServer, and their clients.

Names and signatures follow torchft 0.2.0's ``torchft.coordination``. This package depends only
on grpcio, protobuf and the standard library (no torch).

* :class:`LighthouseServer` / :class:`LighthouseClient`: the job-wide quorum service (docs/design.md, "Roles"),
  with an HTTP dashboard, ``/metrics``, and failure notifications
  (:meth:`LighthouseClient.subscribe_failures`, see :mod:`ft.coordination.clients`).
* :class:`ManagerServer` / :class:`ManagerClient`: one per replica group (docs/design.md, "Roles").
* :class:`Quorum`, :class:`QuorumMember`, :class:`QuorumResult`: plain data classes.
* :mod:`ft.coordination.quorum`: the pure algorithms behind both servers.
"""

from ._rpc import CoordinationError
from .clients import FailureNotification, FailureSubscription, LighthouseClient, ManagerClient
from .lighthouse import LighthouseServer
from .manager_server import ManagerServer
from .quorum import Quorum, QuorumMember, QuorumResult

__all__ = [
    "LighthouseServer",
    "LighthouseClient",
    "ManagerServer",
    "ManagerClient",
    "Quorum",
    "QuorumMember",
    "QuorumResult",
    "FailureNotification",
    "FailureSubscription",
    "CoordinationError",
]
