"""Table tests for the pure ZeRO partition rule (ft.optim.partition)."""

import random

import pytest

from ft.optim.partition import buddy_rank, partition_params

# (group numels, world size, expected per_rank[rank][group] index lists)
TABLE = [
    # Sorted largest first; each to the least-loaded rank.
    ([[1, 2, 3, 4, 5]], 2, [[[4, 1, 0]], [[3, 2]]]),
    # Ties in size keep the group's order; ties in load go to the lowest rank.
    ([[7, 7, 7, 7]], 3, [[[0, 3]], [[1]], [[2]]]),
    # More ranks than parameters: trailing ranks own nothing.
    ([[10, 1]], 4, [[[0]], [[1]], [[]], [[]]]),
    # One huge parameter dominates: everything else fills the other rank.
    ([[1000, 3, 3, 3]], 2, [[[0]], [[1, 2, 3]]]),
    # Zero-sized parameters still get an owner (least-loaded, lowest rank).
    ([[0, 0, 5]], 2, [[[2]], [[0, 1]]]),
    # The load is shared across groups: group 1 continues from group 0's loads.
    ([[6, 5], [4, 4, 1]], 2, [[[0], [1]], [[1], [0, 2]]]),
    # Empty groups are kept (every rank has one local group per global group).
    ([[], [3, 3]], 3, [[[], [0]], [[], [1]], [[], []]]),
    # Single rank owns everything, in sorted order.
    ([[2, 9, 4]], 1, [[[1, 2, 0]]]),
]


@pytest.mark.parametrize("numels,world,expected", TABLE)
def test_table(numels, world, expected):
    part = partition_params(numels, world)
    assert [[list(ix) for ix in groups] for groups in part.per_rank] == expected


def torch_style(numels, world):
    """An independent statement of torch's documented rule, for random cross-checks."""
    sizes = [0] * world
    out = [[[] for _ in numels] for _ in range(world)]
    for g, group in enumerate(numels):
        order = sorted(range(len(group)), key=lambda i: group[i], reverse=True)  # stable
        for i in order:
            r = sizes.index(min(sizes))
            out[r][g].append(i)
            sizes[r] += group[i]
    return out


def test_random_matches_rule_and_owns_each_exactly_once():
    rng = random.Random(7)
    for _ in range(300):
        world = rng.randint(1, 9)
        numels = [
            [
                rng.choice([0, 1, 2, 3, 17, 64, 1000, rng.randint(0, 5000)])
                for _ in range(rng.randint(0, 12))
            ]
            for _ in range(rng.randint(1, 4))
        ]
        part = partition_params(numels, world)
        assert [[list(ix) for ix in gs] for gs in part.per_rank] == torch_style(numels, world)
        for g, group in enumerate(numels):
            owners = [r for r in range(world) for i in part.per_rank[r][g]]
            seen = sorted(i for r in range(world) for i in part.per_rank[r][g])
            assert seen == list(range(len(group)))  # each parameter exactly once
            assert len(owners) == len(group)
            for r in range(world):
                for i in part.per_rank[r][g]:
                    assert part.owner[g][i] == r
        for r in range(world):
            assert part.loads[r] == sum(numels[g][i] for g, i in part.owned(r))
        # Greedy bound: no rank exceeds the mean by more than the largest parameter.
        flat = [n for gr in numels for n in gr]
        if flat:
            assert max(part.loads) <= sum(flat) / world + max(flat)


def test_appending_a_group_moves_nothing():
    base = [[30, 5, 12, 12, 1]]
    before = partition_params(base, 3)
    after = partition_params(base + [[100, 2]], 3)
    for r in range(3):
        assert after.per_rank[r][0] == before.per_rank[r][0]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size"):
        partition_params([[1]], bad)


def test_bad_numel():
    with pytest.raises(ValueError, match="numel"):
        partition_params([[1, -2]], 2)


def test_buddy():
    assert [buddy_rank(r, 3) for r in range(3)] == [1, 2, 0]
    assert buddy_rank(0, 1) == 0
    with pytest.raises(ValueError):
        buddy_rank(3, 3)
