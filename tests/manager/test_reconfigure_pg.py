"""The Manager and the reconfigure API: a group with only ``reconfigure`` is rebuilt from the
handles its ManagerServer and the lighthouse carry between replicas (real processes); a group
that can be rebuilt neither way is refused at construction; a torch group's errors are read
from its backends."""

from __future__ import annotations

from datetime import timedelta
from unittest.mock import Mock

import pytest
import torch
import torch.distributed as dist

import ft
from ft.backend.process_group import ProcessGroupDummy, can_reconfigure
from ft.manager import Manager
from ft.manager_parts.group_rebuild import configures as _configures
from ft.manager_parts.group_rebuild import group_error as _group_error

TARGET = "tests.manager.reconfigure_workers:reconfigure_only_replica"


def test_a_reconfigure_only_group_is_rebuilt_from_handles_across_replicas(replicas) -> None:
    w = replicas(TARGET, 2, lighthouse=dict(min_replicas=2, join_timeout_ms=200), steps=3)
    results = w.join(90)
    for res in results:
        assert res["sums"] == [[1.5, 1.5]] * 3  # the average of 1 and 2: both groups took part
        assert res["size"] == 2
        # One reconfigure for the one quorum, with both replicas' handles, the quorum id as uuid.
        assert [(r["size"], r["n"]) for r in res["reconfigures"]] == [(2, 2)]
    a, b = (res["reconfigures"][0] for res in results)
    assert a["uuid"] == b["uuid"] and {a["rank"], b["rank"]} == {0, 1}


@pytest.mark.skipif(
    not hasattr(dist.ProcessGroup, "reconfigure"),
    reason="torch's own reconfigurable groups need torch 2.14 (the CUDA build lane has it)",
)
def test_a_torch_group_made_reconfigurable_is_rebuilt_across_replicas(replicas) -> None:
    """torch 2.14's Gloo group, made with enable_reconfigure=True, in place of ft's: the
    Manager rebuilds it at each new quorum from the members' handles, and both replicas'
    allreduces average across the two groups."""
    w = replicas(
        "tests.manager.reconfigure_workers:torch_group_replica",
        2,
        lighthouse=dict(min_replicas=2, join_timeout_ms=200),
        steps=3,
    )
    for res in w.join(90):
        assert res["sums"] == [[1.5, 1.5]] * 3, res
        assert res["size"] == 2, res


def test_a_group_that_cannot_be_rebuilt_is_refused() -> None:
    # A plain torch group: no configure(), and on torch < 2.14 no reconfigure either (on 2.14
    # only one made with enable_reconfigure=True supports it).
    pg = dist.ProcessGroup(dist.HashStore(), 0, 1)
    if can_reconfigure(pg):
        pytest.skip("this torch's plain group supports reconfigure")
    with pytest.raises(ValueError, match="enable_reconfigure=True"):
        Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=1)


def test_which_groups_are_configured_and_which_reconfigured() -> None:
    from tests.manager.reconfigure_workers import ReconfigureOnly

    assert _configures(ft.ProcessGroupGloo())
    assert _configures(ProcessGroupDummy(0, 1))
    assert not _configures(ReconfigureOnly())
    assert not _configures(dist.ProcessGroup(dist.HashStore(), 0, 1))


def test_reconfigure_pg_passes_the_handles_and_the_quorum_id() -> None:
    manager = Manager.__new__(Manager)  # only the reconfigure path: no servers
    manager._pg = pg = Mock()
    manager._timeout = timedelta(seconds=7)
    manager._reconfigure_pg(42, ["a", "b"])
    (opts,) = pg.reconfigure.call_args.args
    assert (opts.uuid, list(opts.handles), opts.timeout) == (42, ["a", "b"], timedelta(seconds=7))
    pg.reconfigure.return_value.wait.assert_called_once_with()
    # A member that sent no handle (torchft 0.2.0, an older ft): a clear error, no reconfigure.
    pg.reset_mock()
    with pytest.raises(RuntimeError, match="not every member sent a reconfigure handle"):
        manager._reconfigure_pg(43, ["a", ""])
    pg.reconfigure.assert_not_called()


def test_a_torch_groups_error_is_read_from_its_backends() -> None:
    ErrorType = torch._C._distributed_c10d.ErrorType
    backend = Mock(spec=["get_error"])
    group = Mock(spec=["_device_types", "_get_backend"])
    group._device_types = [torch.device("cpu")]
    group._get_backend.return_value = backend
    backend.get_error.return_value = ErrorType.SUCCESS
    assert _group_error(group) is None
    backend.get_error.return_value = ErrorType.COMM_ERROR
    err = _group_error(group)
    assert isinstance(err, dist.DistBackendError) and "COMM_ERROR" in str(err)
