"""Where a replica says it lives: ft.utils.net and the Manager's refusal to advertise loopback
to a lighthouse on another host (docs/multihost.md, "Addresses")."""

from __future__ import annotations

from datetime import timedelta

import pytest

import ft
from ft.utils import net

# (advertised host, peer, refused?)
CASES = [
    ("127.0.0.1", "127.0.0.1", False),
    ("localhost", "127.0.0.1", False),
    ("::1", "::1", False),
    ("10.213.77.11", "10.213.77.10", False),
    ("127.0.0.1", "10.213.77.10", True),
    ("localhost", "10.213.77.10", True),
    ("::1", "10.213.77.10", True),
    ("127.0.1.1", "lighthouse.example", True),
]


@pytest.mark.parametrize("host,peer,refused", CASES)
def test_loopback_advertised_to_a_remote_peer_is_refused(host, peer, refused):
    if refused:
        with pytest.raises(ValueError, match="FT_ADVERTISE_HOST") as e:
            net.check_reachable_advertisement(host, peer, "replica 'x'")
        assert host in str(e.value) and peer in str(e.value)
    else:
        net.check_reachable_advertisement(host, peer, "replica 'x'")


def test_route_source_finds_the_interface_toward_a_peer():
    assert net.route_source("127.0.0.1") == "127.0.0.1"
    assert net.route_source("no-such-host.invalid") is None


def test_env_wins_over_the_process_choice(monkeypatch):
    monkeypatch.setenv("FT_ADVERTISE_HOST", "192.0.2.55")
    assert net.advertise_host(toward="127.0.0.1") == "192.0.2.55"
    monkeypatch.delenv("FT_ADVERTISE_HOST")
    assert net.advertise_host(toward="127.0.0.1") in ("127.0.0.1", net.chosen_advertise_host())


def test_manager_refuses_loopback_toward_a_remote_lighthouse(monkeypatch):
    """The misconfiguration that otherwise commits nothing, silently: fails at start, naming
    the setting, before anything connects."""
    monkeypatch.setenv("FT_ADVERTISE_HOST", "127.0.0.1")
    with pytest.raises(ValueError, match="FT_ADVERTISE_HOST"):
        ft.Manager(
            pg=ft.ProcessGroupGloo(),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=0,
            lighthouse_addr="http://192.0.2.77:29510",
            connect_timeout=timedelta(seconds=1),
        )
