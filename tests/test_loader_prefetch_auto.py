"""`DataLoader(prefetch_factor="auto")` on real executors, with a worker count or with
num_workers="auto": its tuner's changes of the prefetch bound go through the core's
`PrefetchChangeRequested`, and whatever it does the epoch's batches are torch's. The policy is
replaced here by a script, so nothing depends on how fast this machine runs; the policy itself
is tests/test_tuning_prefetch.py's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.data
from _datasets import Numbers

import statecore
from statecore import LoadWindow, PrefetchBudget, PrefetchDecision, PrefetchTuner, TuningMove
from statecore.executors._autotune import AutoPrefetch, AutoTuner, AutoWorkers

pytestmark = pytest.mark.timeout(120)

EXECUTORS = [{"executor": "mp", "multiprocessing_context": "fork"}, {"executor": "thread"}]
Decide = Callable[[PrefetchTuner, LoadWindow, PrefetchBudget], tuple[PrefetchTuner, Any]]


def _scripted(bounds: list[int], seen: list[int] | None = None) -> Decide:
    """A prefetch policy that sets `bounds`, one a window, then holds; `seen` gets the bound
    the loader's scheduler had when each window was handed over."""
    left = iter(bounds)

    def decide(
        tuner: PrefetchTuner, window: LoadWindow, budget: PrefetchBudget
    ) -> tuple[PrefetchTuner, PrefetchDecision]:
        bound = next(left, None)
        if bound is None:
            return tuner, PrefetchDecision(TuningMove.HOLD, tuner.prefetch, "scripted hold")
        move = TuningMove.RAISE_PREFETCH if bound > tuner.prefetch else TuningMove.LOWER_PREFETCH
        changed = PrefetchTuner(bound, changed_at=window.batch, changes=tuner.changes + 1)
        return changed, PrefetchDecision(move, bound, f"scripted {bound}")

    return decide


def _tuned(
    dataset: Any, decide: Decide, num_workers: Any = 2, **options: Any
) -> statecore.DataLoader[Any]:
    loader = statecore.DataLoader(
        dataset, num_workers=num_workers, prefetch_factor="auto", **options
    )
    assert isinstance(loader.prefetch_factor, AutoPrefetch)
    workers = isinstance(loader.num_workers, AutoWorkers)
    loader._autotuner = AutoTuner(
        int(loader.num_workers),
        window_seconds=0,
        tunes_workers=workers,
        prefetch=int(loader.prefetch_factor),
        decide_prefetch=decide,
    )
    return loader


def _torchs(dataset: Any, **options: Any) -> list[torch.Tensor]:
    return list(torch.utils.data.DataLoader(dataset, num_workers=0, **options))


def _equal(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def _bound(loader: statecore.DataLoader[Any]) -> int:
    driver = loader._latest()._driver  # type: ignore[misc,union-attr]
    return int(driver.state.config.prefetch_factor)


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_whatever_the_prefetch_tuner_does_the_epoch_is_torchs(where: dict[str, Any]) -> None:
    loader = _tuned(Numbers(300), _scripted([4, 1, 3, 8, 2]), batch_size=2, **where)
    _equal(list(loader), _torchs(Numbers(300), batch_size=2))
    tuning = loader.stats().tuning
    assert tuning is not None
    assert [record.prefetch for record in tuning.decisions] == [4, 1, 3, 8, 2]


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_the_prefetch_tuners_bound_is_the_schedulers(where: dict[str, Any]) -> None:
    loader = _tuned(Numbers(200), _scripted([5]), batch_size=2, **where)
    iterator = iter(loader)
    assert _bound(loader) == 2
    for _ in range(60):
        next(iterator)
    assert _bound(loader) == 5
    list(iterator)


def test_out_of_order_whatever_the_prefetch_tuner_does_every_batch_comes_once() -> None:
    decide = _scripted([1, 6, 1])
    loader = _tuned(Numbers(300), decide, batch_size=3, in_order=False, executor="thread")
    assert sorted(int(x) for batch in loader for x in batch) == list(range(300))


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_with_num_workers_auto_both_are_tuned_and_the_epoch_is_torchs(
    where: dict[str, Any],
) -> None:
    loader = _tuned(Numbers(300), _scripted([4]), num_workers="auto", batch_size=2, **where)
    _equal(list(loader), _torchs(Numbers(300), batch_size=2))
    tuning = loader.stats().tuning
    assert tuning is not None and tuning.prefetch == 4 and tuning.tunes_workers


def test_the_learned_bound_carries_into_the_next_epoch() -> None:
    loader = _tuned(Numbers(200), _scripted([6]), batch_size=2, executor="thread")
    list(loader)
    iterator = iter(loader)
    assert _bound(loader) == 6
    list(iterator)


def test_the_learned_bound_carries_into_the_next_epoch_of_persistent_workers() -> None:
    decide = _scripted([6])
    loader = _tuned(Numbers(200), decide, batch_size=2, executor="thread", persistent_workers=True)
    list(loader)
    iterator = iter(loader)
    assert _bound(loader) == 6
    list(iterator)


def test_stats_and_the_verdict_report_the_prefetch_decisions() -> None:
    loader = _tuned(Numbers(200), _scripted([4]), batch_size=2, executor="thread")
    list(loader)
    verdict = loader.stats().verdict()
    assert 'prefetch_factor="auto": 4 batch(es) in advance per worker' in verdict
    assert "raised prefetch_factor to 4: scripted 4" in verdict
    assert "To pin it: prefetch_factor=4." in verdict


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_a_fixed_count_with_auto_prefetch_runs_every_worker_from_the_start() -> None:
    loader = _tuned(Numbers(40), _scripted([]), num_workers=3, batch_size=2, executor="thread")
    iterator = iter(loader)
    assert loader.stats().counters.workers.count(statecore.WorkerStatus.ACTIVE) == 3  # type: ignore[union-attr]
    list(iterator)


def test_auto_prefetch_needs_workers_and_says_so() -> None:
    with pytest.raises(
        ValueError, match=r'prefetch_factor="auto".*num_workers=0.*num_workers >= 1'
    ):
        statecore.DataLoader(Numbers(4), num_workers=0, prefetch_factor="auto")


@pytest.mark.parametrize("value", ["many", "Auto", ""])
def test_another_prefetch_string_is_refused_in_words(value: str) -> None:
    with pytest.raises(ValueError, match=r'prefetch_factor must be an integer.*or "auto"'):
        statecore.DataLoader(Numbers(4), num_workers=2, prefetch_factor=value)  # type: ignore[arg-type]


def test_a_loader_rebuilt_from_its_attributes_tunes_its_prefetch_again() -> None:
    loader = statecore.DataLoader(Numbers(4), num_workers=2, prefetch_factor="auto")
    again = statecore.DataLoader(
        loader.dataset, num_workers=loader.num_workers, prefetch_factor=loader.prefetch_factor
    )
    assert isinstance(again.prefetch_factor, AutoPrefetch)


def test_auto_prefetch_set_after_the_loader_was_built_is_auto() -> None:
    loader = statecore.DataLoader(Numbers(8), num_workers=2, batch_size=2)
    loader.prefetch_factor = "auto"  # type: ignore[assignment]
    assert isinstance(loader.prefetch_factor, AutoPrefetch)
    assert [int(x) for batch in loader for x in batch] == list(range(8))
    assert loader.stats().tuning is not None
