"""The reference semantics say what an epoch hands over, computed the obvious way."""

from statecore.models.reference import (
    IterableSpec,
    MapSpec,
    expected_epoch,
    iterable_batch,
    map_batch,
)


def test_a_map_style_epoch_hands_over_every_index_in_sampler_order() -> None:
    assert expected_epoch(MapSpec(3), epoch=1) == [
        ("data", (1, 0)),
        ("data", (1, 1)),
        ("data", (1, 2)),
    ]


def test_a_failing_index_is_handed_over_as_an_error_in_its_turn() -> None:
    assert map_batch(MapSpec(3, frozenset({1})), 2, 1) == ("error", (2, 1))
    assert [kind for kind, _ in expected_epoch(MapSpec(3, frozenset({1})), 1)] == [
        "data",
        "error",
        "data",
    ]


def test_iterable_workers_take_turns_and_a_dry_worker_drops_out() -> None:
    spec = IterableSpec((1, 3, 2))
    assert [value for _, value in expected_epoch(spec, epoch=1)] == [
        (0, 1, 0),
        (1, 1, 0),
        (2, 1, 0),
        (1, 1, 1),
        (2, 1, 1),
        (1, 1, 2),
    ]


def test_a_worker_with_an_empty_shard_yields_nothing() -> None:
    assert iterable_batch(IterableSpec((0, 1)), worker=0, epoch=1, k=0) is None
    assert expected_epoch(IterableSpec((0, 0)), epoch=1) == []
