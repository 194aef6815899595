import pytest

from tests.multihost.netns import Hosts, unavailable_reason


@pytest.fixture
def hosts_factory():
    """hosts_factory(["lh", "a", "b"]) -> Hosts; every namespace and process is gone after
    the test, pass or fail."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")
    made = []

    def make(names):
        h = Hosts(names)
        made.append(h)
        return h

    try:
        yield make
    finally:
        for h in made:
            h.close()
