"""The seams of ft.protocols: ft.Manager and the test double both provide every member that
algorithms use, so the double cannot drift from the Manager unnoticed."""

from __future__ import annotations

import inspect

import pytest

import ft
from ft.coordination import ManagerClient
from ft.coordination.manager_server import LocalManagerClient
from ft.protocols import GroupServerClient, ManagerLike
from tests.diloco.fake_manager import FakeGroup, FakeManager


def _members(proto) -> set:
    return {n for n in vars(proto) if not n.startswith("_")}


def test_the_protocol_names_what_algorithms_call():
    assert {
        "use_async_quorum",
        "num_lanes",
        "start_quorum",
        "allreduce",
        "should_commit",
        "register_state_dict_fn",
        "current_step",
        "num_participants",
    } <= _members(ManagerLike)


@pytest.mark.parametrize(
    "proto, impl",
    [
        (ManagerLike, ft.Manager),
        (ManagerLike, FakeManager),
        (GroupServerClient, ManagerClient),
        (GroupServerClient, LocalManagerClient),
    ],
    ids=["Manager", "FakeManager", "ManagerClient", "LocalManagerClient"],
)
def test_every_member_exists_with_compatible_parameters(proto, impl):
    for name in _members(proto):
        assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
        want = getattr(proto, name)
        have = getattr(impl, name)
        assert isinstance(want, property) == isinstance(have, property), name
        if callable(want) and not isinstance(want, property):
            wanted = [p for p in inspect.signature(want).parameters if p != "self"]
            given = inspect.signature(have).parameters
            missing = [p for p in wanted if p not in given]
            assert not missing, f"{impl.__name__}.{name} lacks parameters {missing}"


def test_the_fake_is_a_manager_like_at_run_time():
    fake = FakeManager(FakeGroup(1), 0, use_async_quorum=True, num_lanes=3)
    assert isinstance(fake, ManagerLike)
    assert fake.use_async_quorum is True and fake.num_lanes == 3
    assert not isinstance(object(), ManagerLike)


@pytest.mark.parametrize("impl", [ManagerClient, LocalManagerClient])
def test_torchft_s_names_are_the_same_calls(impl):
    # The Manager and the Healer call _quorum and _checkpoint_metadata (torchft's names, so a
    # stand-in for torchft's client drives them): they must stay the public calls themselves.
    assert impl._quorum is impl.quorum
    assert impl._checkpoint_metadata is impl.checkpoint_metadata
