import pytest

from notebook_dist.errors import RankSpecError
from notebook_dist.ranks import parse_ranks


@pytest.mark.parametrize(
    "spec, world, want",
    [
        ("all", 4, [0, 1, 2, 3]),
        ("ALL", 2, [0, 1]),
        (None, 3, [0, 1, 2]),
        ("0", 2, [0]),
        ("0,2", 4, [0, 2]),
        ("1-3", 4, [1, 2, 3]),
        ("3, 0-1", 4, [0, 1, 3]),
        ("1,1", 2, [1]),
        (1, 2, [1]),
        ([1, 0], 2, [0, 1]),
    ],
)
def test_valid_specs(spec, world, want):
    assert parse_ranks(spec, world) == want


@pytest.mark.parametrize(
    "spec, world, message",
    [
        ("5", 2, "rank 5 not in this cluster: it has 2 ranks (ranks 0-1)"),
        ("0,7-8", 4, "ranks 7, 8 not in this cluster: it has 4 ranks (ranks 0-3)"),
        ("1", 1, "rank 1 not in this cluster: it has 1 rank (rank 0)"),
        (
            "x",
            2,
            "bad rank specification 'x': use 'all', a rank like '0', a list like '0,2' or a range like '1-3'",
        ),
        ("3-1", 4, "bad rank range '3-1': the start is after the end"),
        ("0,,1", 2, "bad rank specification '0,,1': empty item"),
        ("", 2, "empty rank specification"),
        ("-1", 2, "bad rank specification '-1'"),
        ("__import__('os')", 2, "bad rank specification"),
        ([True], 2, "ranks must be integers, got True"),
    ],
)
def test_bad_specs_say_what_to_do(spec, world, message):
    with pytest.raises(RankSpecError) as info:
        parse_ranks(spec, world)
    assert message in str(info.value)
