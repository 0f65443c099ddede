"""`DataLoader(num_workers="auto")` on real executors: it starts two workers, its tuner's
decisions go through the core's add and retire, and whatever the tuner does the epoch's batches
are torch's. The tuner's policy is replaced here by a script (`_scripted`), so nothing depends on
how fast this machine runs; the policy itself is tests/test_tuning_policy.py's."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
import torch.utils.data
from _datasets import Numbers
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import statecore
from statecore import (
    LoadWindow,
    Tuner,
    Tuning,
    TuningDecision,
    TuningMove,
    WorkerBudget,
    WorkerStatus,
    decide_workers,
)
from statecore.executors import Launch
from statecore.executors import _autotune as autotune
from statecore.executors._autotune import (
    AutoTuner,
    AutoTuning,
    AutoWorkers,
    cpu_budget,
    slots_for,
)
from statecore.executors._inline import InlineExecutor

pytestmark = pytest.mark.timeout(120)

EXECUTORS = [{"executor": "mp", "multiprocessing_context": "fork"}, {"executor": "thread"}]
ADD, RETIRE, HOLD = TuningMove.ADD, TuningMove.RETIRE, TuningMove.HOLD
Decide = Callable[[Tuner, LoadWindow, WorkerBudget], tuple[Tuner, TuningDecision]]


def _scripted(moves: list[TuningMove], seen: list[LoadWindow] | None = None) -> Decide:
    """A policy that makes `moves`, one a window, then holds; `seen` gets every window."""
    left = iter(moves)

    def decide(
        tuner: Tuner, window: LoadWindow, budget: WorkerBudget
    ) -> tuple[Tuner, TuningDecision]:
        if seen is not None:
            seen.append(window)
        move = next(left, HOLD)
        return tuner, TuningDecision(move, f"scripted {move.value}")

    return decide


def _auto(dataset: Any, decide: Decide, **options: Any) -> statecore.DataLoader[Any]:
    loader = statecore.DataLoader(dataset, num_workers="auto", **options)
    assert isinstance(loader.num_workers, AutoWorkers)
    # Windows of 16 batches, however quickly they come: no figure depends on this machine.
    loader._autotuner = AutoTuner(loader.num_workers, decide=decide, window_seconds=0)
    return loader


def _on_a_loop_clock(
    where: dict[str, Any], decide: Decide, step: float, wait: float, **tuner: Any
) -> statecore.DataLoader[Any]:
    """An auto loader of 200 batches whose tuner reads `_LoopClock(step, wait)`: each batch
    takes `step + wait` seconds of its clock, `wait` of them waited."""
    loader = statecore.DataLoader(Numbers(400), batch_size=2, num_workers="auto", **where)
    loader._autotuner = AutoTuner(
        16, cpus=2, decide=decide, clock=_LoopClock(step=step, wait=wait), **tuner
    )
    return loader


def _torchs(dataset: Any, **options: Any) -> list[torch.Tensor]:
    return list(torch.utils.data.DataLoader(dataset, num_workers=0, **options))


def _equal(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def _running(loader: statecore.DataLoader[Any]) -> int:
    return loader.stats().counters.workers.count(WorkerStatus.ACTIVE)  # type: ignore[union-attr]


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_whatever_the_tuner_does_the_epoch_is_torchs(where: dict[str, Any]) -> None:
    moves = [ADD, ADD, RETIRE, ADD, RETIRE, RETIRE, ADD]
    loader = _auto(Numbers(1000), _scripted(moves), batch_size=2, **where)
    got = list(loader)
    _equal(got, _torchs(Numbers(1000), batch_size=2))
    tuning = loader.stats().tuning
    assert tuning is not None
    # An added worker takes no turn until it has started, and no window is measured before:
    # how many of the moves an epoch makes room for depends on how fast processes start.
    made = len(tuning.decisions)
    assert made >= 2
    assert [record.move for record in tuning.decisions] == moves[:made]
    assert [record.workers for record in tuning.decisions] == [3, 4, 3, 4, 3, 2, 3][:made]


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_out_of_order_whatever_the_tuner_does_every_batch_comes_once(
    where: dict[str, Any],
) -> None:
    moves = [ADD, ADD, RETIRE, RETIRE, ADD]
    loader = _auto(Numbers(300), _scripted(moves), batch_size=3, in_order=False, **where)
    got = sorted(int(x) for batch in loader for x in batch)
    assert got == list(range(300))


class WhoLoads(Dataset):  # type: ignore[type-arg]
    """Item i is (i, the loading worker's id, its get_worker_info().num_workers)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        info = get_worker_info()
        assert info is not None
        return index, info.id, info.num_workers


def test_an_auto_loader_on_two_cores_has_sixteen_slots_for_io_bound_samples() -> None:
    # Samples that wait on I/O are served best by many more workers than cores.
    assert slots_for(2) == 16
    assert slots_for(1) == 16
    assert slots_for(4) == 32


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_an_auto_loader_starts_two_workers_of_its_slots(where: dict[str, Any]) -> None:
    loader = _auto(WhoLoads(), _scripted([]), batch_size=None, **where)
    slots = int(loader.num_workers)
    assert slots == slots_for(cpu_budget())
    iterator = iter(loader)
    assert _running(loader) == 2
    items = list(iterator)
    # get_worker_info().num_workers names the slots, so that ids are below it.
    assert {(worker, count) for _, worker, count in items} == {(0, slots), (1, slots)}


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_with_persistent_workers_the_learned_count_carries_into_the_next_epoch(
    where: dict[str, Any],
) -> None:
    loader = _auto(Numbers(200), _scripted([ADD]), batch_size=2, persistent_workers=True, **where)
    first = list(loader)
    assert loader._autotuner is not None and loader._autotuner.workers == 3
    iterator = iter(loader)
    assert _running(loader) == 3
    second = list(iterator)
    expected = _torchs(Numbers(200), batch_size=2)
    _equal(first, expected)
    _equal(second, expected)


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_without_persistent_workers_the_next_epoch_starts_with_the_learned_count(
    where: dict[str, Any],
) -> None:
    loader = _auto(Numbers(1000), _scripted([ADD, ADD, RETIRE]), batch_size=2, **where)
    first = list(loader)
    iterator = iter(loader)
    assert _running(loader) == 3
    second = list(iterator)
    expected = _torchs(Numbers(1000), batch_size=2)
    _equal(first, expected)
    _equal(second, expected)


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_the_tuner_is_given_windows_of_what_the_loader_measured(where: dict[str, Any]) -> None:
    seen: list[LoadWindow] = []
    loader = _auto(Numbers(200), _scripted([], seen), batch_size=2, **where)
    list(loader)
    assert len(seen) >= 5
    assert [window.batches for window in seen] == [8] + [16] * (len(seen) - 1)
    for window in seen:
        assert window.running == 2
        assert 0 <= window.waited <= window.seconds
        assert 0 <= window.longest_gap <= window.seconds
        assert 0 <= window.busy <= 1
        # Cores kept busy by this process and its worker processes, and the cores' worth of time
        # they waited in the run queue: measured, whatever the values.
        assert window.cpu is not None and window.cpu >= 0
        assert window.queued is not None and window.queued >= 0
    assert [w.batch for w in seen] == sorted({w.batch for w in seen})


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_no_window_begins_within_the_cooldown_after_a_change(where: dict[str, Any]) -> None:
    # The policy holds on a window begun within the cool-down: measuring one would only delay
    # the next decision by a whole window.
    seen: list[LoadWindow] = []
    loader = _auto(Numbers(1000), _scripted([ADD], seen), batch_size=2, **where)
    list(loader)
    tuning = loader.stats().tuning
    assert tuning is not None
    (record,) = tuning.decisions
    later = [window for window in seen if window.batch > record.batch]
    assert later
    assert all(window.first >= record.batch + Tuning().cooldown for window in later)


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_a_starving_loop_is_measured_over_eight_batches_first_then_sixteen(
    where: dict[str, Any],
) -> None:
    # Each batch takes 10 ms of the tuner's clock, 9 of them waited: the loop starves from the
    # start, so no window waits for half a second. The first is made by the two workers a
    # loader starts with, each of its batches starved for: it is half as long.
    seen: list[LoadWindow] = []
    loader = _on_a_loop_clock(where, _scripted([], seen), step=0.001, wait=0.009)
    list(loader)
    assert [window.batches for window in seen] == [8] + [16] * (len(seen) - 1)
    assert len(seen) > 3


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_only_the_tuners_first_window_is_short_not_each_epochs(where: dict[str, Any]) -> None:
    # The next epoch's workers are the count the tuner learned, not the two it started with.
    seen: list[LoadWindow] = []
    loader = _auto(
        Numbers(200), _scripted([], seen), batch_size=2, persistent_workers=True, **where
    )
    list(loader)
    first_epoch = len(seen)
    list(loader)
    assert first_epoch >= 2 and len(seen) > first_epoch
    assert [window.batches for window in seen] == [8] + [16] * (len(seen) - 1)


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_a_loop_that_does_not_starve_is_measured_over_half_a_second(
    where: dict[str, Any],
) -> None:
    # Each batch takes 10 ms, 1 of them waited: windows cover half a second, 51 batches (the
    # first begins after the batches loaded during start-up).
    seen: list[LoadWindow] = []
    loader = _on_a_loop_clock(where, _scripted([], seen), step=0.009, wait=0.001)
    list(loader)
    assert seen and all(window.batches == 51 for window in seen)


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_a_loop_that_does_not_starve_is_measured_after_the_batches_loaded_during_start_up(
    where: dict[str, Any],
) -> None:
    # While the first batch waits for the workers to start, they load the batches after it (two
    # workers, two tasks each: at least three more in flight), and those come at once. Counted,
    # they make the half second that judges the next add look faster than the workers are.
    seen: list[LoadWindow] = []
    loader = _on_a_loop_clock(where, _scripted([], seen), step=0.009, wait=0.001)
    list(loader)
    assert seen and seen[0].first >= 1 + 3
    assert all(window.ahead == 0 for window in seen)


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_a_starving_loop_is_measured_from_its_second_batch(where: dict[str, Any]) -> None:
    # A loop that starves is decided on its waiting: its jump is not delayed by the batches
    # loaded during start-up.
    seen: list[LoadWindow] = []
    loader = _on_a_loop_clock(where, _scripted([], seen), step=0.001, wait=0.009)
    list(loader)
    assert seen and seen[0].first == 1


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_a_starving_loops_first_window_leaves_the_batches_loaded_during_start_up_out_of_its_rate(
    where: dict[str, Any],
) -> None:
    # Two workers of two tasks each: at least three batches were in flight as the first was
    # handed over. The window counts them (its waiting decides), its rate does not: each batch
    # takes 10 ms of the loop's clock, so the rate is 100 a second whatever the workers did.
    seen: list[LoadWindow] = []
    loader = _on_a_loop_clock(where, _scripted([], seen), step=0.001, wait=0.009)
    list(loader)
    first, *later = seen
    assert 3 <= first.ahead < first.batches
    assert first.rate == pytest.approx(100.0)
    assert later and all(window.ahead == 0 for window in later)


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_each_epochs_start_up_batches_are_left_out_of_its_first_windows_rate(
    where: dict[str, Any],
) -> None:
    # Persistent workers load the next epoch's first batches as its iterator starts.
    seen: list[LoadWindow] = []
    loader = _on_a_loop_clock(
        {**where, "persistent_workers": True}, _scripted([], seen), step=0.001, wait=0.009
    )
    list(loader)
    list(loader)
    assert [window.first for window in seen if window.ahead] == [1, len(loader) + 1]


def _judging_after_the_first(seen: list[LoadWindow]) -> Decide:
    """A policy that, on its first window, holds to judge an add over a longer window
    (`Tuner.judging`), and judges it on the next."""

    def decide(
        tuner: Tuner, window: LoadWindow, budget: WorkerBudget
    ) -> tuple[Tuner, TuningDecision]:
        seen.append(window)
        judging = len(seen) == 1
        return attrs.evolve(tuner, judging=judging), TuningDecision(HOLD, "judging")

    return decide


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_an_add_a_starving_window_could_not_judge_is_judged_over_half_a_second(
    where: dict[str, Any],
) -> None:
    # The loop starves (9 ms waited of each 10): short windows (the first 8 batches, then 16),
    # but the one after the policy asked for a longer judgement covers half a second (51).
    seen: list[LoadWindow] = []
    loader = _on_a_loop_clock(where, _judging_after_the_first(seen), step=0.001, wait=0.009)
    list(loader)
    assert [window.batches for window in seen[:3]] == [8, 51, 16]


def test_stats_and_the_verdict_report_the_decisions() -> None:
    loader = _auto(Numbers(200), _scripted([ADD]), batch_size=2, executor="thread")
    list(loader)
    stats = loader.stats()
    assert stats.tuning is not None
    (record,) = stats.tuning.decisions
    assert record.move is ADD and record.workers == 3 and record.why == "scripted add"
    assert record.batch > 8 and record.epoch == 1
    verdict = stats.verdict()
    assert 'num_workers="auto"' in verdict
    assert "added a worker, 3 now: scripted add" in verdict


# --- refusals ---------------------------------------------------------------------------------


class Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


def test_auto_is_refused_for_an_iterable_dataset() -> None:
    with pytest.raises(ValueError, match=r'num_workers="auto" needs a map-style dataset') as e:
        statecore.DataLoader(Stream(), num_workers="auto")
    assert "Pick a count: num_workers=N" in str(e.value)
    assert "Stream" in str(e.value)


@attrs.frozen
class _NoReplacing:
    """An executor factory declaring nothing: it cannot start a worker mid-epoch."""

    def __call__(self, launch: Launch) -> InlineExecutor:  # pragma: no cover - refused first
        return InlineExecutor(launch)


def test_auto_is_refused_on_an_executor_that_cannot_start_workers() -> None:
    with pytest.raises(ValueError, match=r"_NoReplacing.*cannot \(it does not declare"):
        statecore.DataLoader(Numbers(4), num_workers="auto", executor=_NoReplacing())


def test_auto_is_refused_on_the_inline_executor_saying_why() -> None:
    with pytest.raises(ValueError, match=r'num_workers="auto" runs up to \d+ workers.*inline'):
        statecore.DataLoader(Numbers(4), num_workers="auto", executor="inline")


@pytest.mark.parametrize("value", ["many", "Auto", ""])
def test_another_string_is_refused_in_torchs_words(value: str) -> None:
    with pytest.raises(ValueError, match=r'num_workers option should be non-negative, or "auto"'):
        statecore.DataLoader(Numbers(4), num_workers=value)


def test_a_negative_count_is_still_refused_as_torch_refuses_it() -> None:
    with pytest.raises(ValueError, match="num_workers option should be non-negative"):
        statecore.DataLoader(Numbers(4), num_workers=-1)


def test_auto_set_after_the_loader_was_built_is_auto() -> None:
    loader = statecore.DataLoader(Numbers(4), num_workers=2)
    loader.num_workers = "auto"  # type: ignore[assignment]
    assert isinstance(loader.num_workers, AutoWorkers)
    assert [int(b) for b in loader] == [0, 1, 2, 3]


def test_a_loader_rebuilt_from_its_attributes_is_auto_again() -> None:
    loader = statecore.DataLoader(Numbers(4), num_workers="auto")
    again = statecore.DataLoader(loader.dataset, num_workers=loader.num_workers)
    assert isinstance(again.num_workers, AutoWorkers)
    assert int(again.num_workers) == int(loader.num_workers)


AUTO_SCRIPT = """
import attrs
from _datasets import Numbers
from statecore import DataLoader, TuningDecision, TuningMove
from statecore.executors._autotune import AutoTuner

def add_once_then_settle(tuner, window, budget):
    if tuner.changes == 0:
        return attrs.evolve(tuner, changes=1), TuningDecision(TuningMove.ADD, "scripted add")
    return attrs.evolve(tuner, settled=True), TuningDecision(TuningMove.HOLD, "scripted hold")

loader = DataLoader(Numbers(200), batch_size=2, num_workers="auto", executor="thread")
loader._autotuner = AutoTuner(
    loader.num_workers, decide=add_once_then_settle, window_seconds=0
)
for batch in loader:
    pass
"""


def test_profile_names_the_count_an_auto_loader_settled_on(tmp_path: Any) -> None:
    import io
    import os

    from statecore.tools.profile import profile

    script = tmp_path / "auto.py"
    script.write_text(AUTO_SCRIPT)
    out, err = io.StringIO(), io.StringIO()
    tests = os.path.dirname(os.path.abspath(__file__))
    import sys

    sys.path.insert(0, tests)
    try:
        status = profile(str(script), (), tmp_path / "out", out, err, progress_bar=False)
    finally:
        sys.path.remove(tests)
    assert status == 0, err.getvalue()
    shown = out.getvalue()
    assert 'num_workers="auto": settled on 3 worker(s) after 1 change(s)' in shown
    assert 'To pin it: num_workers=3, seeding="per-batch".' in shown
    assert (
        'To pin it: num_workers=3, seeding="per-batch".'
        in (tmp_path / "out" / "loader-0.verdict.txt").read_text()
    )


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_a_checkpoint_of_an_auto_loader_resumes_exactly(where: dict[str, Any]) -> None:
    loader = _auto(Numbers(200), _scripted([ADD, ADD, RETIRE]), batch_size=2, **where)
    iterator = iter(loader)
    first = [next(iterator) for _ in range(60)]
    state = loader.state_dict()
    del iterator
    resumed = _auto(Numbers(200), _scripted([ADD]), batch_size=2, **where)
    resumed.load_state_dict(state)
    rest = list(resumed)
    _equal(first + rest, _torchs(Numbers(200), batch_size=2))


class _LoopClock:
    """A clock for the tuner in which every batch takes the training loop `step` seconds and
    is waited for `wait` seconds, whatever this machine does: asked, then handed over, in turn."""

    def __init__(self, step: float, wait: float) -> None:
        self.now = 0.0
        self.step, self.wait = step, wait
        self.asking = True

    def __call__(self) -> float:
        self.now += self.step if self.asking else self.wait
        self.asking = not self.asking
        return self.now


def _cores(cpu: float | None) -> Decide:
    """The real policy, told the cores the loader kept busy were `cpu` (None: not measured),
    and that it waited for none in the run queue (this machine's load is no part of a test)."""

    def decide(
        tuner: Tuner, window: LoadWindow, budget: WorkerBudget
    ) -> tuple[Tuner, TuningDecision]:
        return decide_workers(tuner, attrs.evolve(window, cpu=cpu, queued=None), budget)

    return decide


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_the_real_policy_adds_for_a_waiting_loop_and_undoes_an_add_that_does_not_pay(
    where: dict[str, Any],
) -> None:
    # The loop waits 90% of its time, and batches come no faster with more workers (the clock
    # says so), the cores unmeasured: the tuner doubles the count, finds the two it added did
    # not pay, retires both and settles.
    loader = statecore.DataLoader(Numbers(1000), batch_size=2, num_workers="auto", **where)
    clock = _LoopClock(step=0.001, wait=0.009)
    loader._autotuner = AutoTuner(16, cpus=2, decide=_cores(None), clock=clock, window_seconds=0)
    got = list(loader)
    _equal(got, _torchs(Numbers(1000), batch_size=2))
    tuning = loader.stats().tuning
    assert tuning is not None
    assert [(r.move, r.workers) for r in tuning.decisions] == [(ADD, 4), (RETIRE, 2)]
    assert "waited 91%" in tuning.decisions[0].why  # 16 waits of 9 ms over 16 + 15 steps
    assert "workers 3-4 did not pay" in tuning.decisions[1].why
    assert tuning.settled and tuning.workers == 2


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_the_real_policy_goes_to_its_slots_for_a_starving_loop_with_cores_to_spare(
    where: dict[str, Any],
) -> None:
    # The same starving loop, the loader using a tenth of a core: it calls for ten times the
    # workers, and the cores have room for them: one add, up to the slots.
    loader = _on_a_loop_clock(where, _cores(0.1), step=0.001, wait=0.009, window_seconds=0)
    got = list(loader)
    _equal(got, _torchs(Numbers(400), batch_size=2))
    tuning = loader.stats().tuning
    assert tuning is not None
    assert [(r.move, r.workers) for r in tuning.decisions] == [(ADD, 16)]
    assert tuning.workers == 16
    assert "added 14 workers, 16 now" in tuning.decisions[-1].describe()


def _settling(seen: list[LoadWindow]) -> Decide:
    """A policy that settles at once, holding: `seen` gets every window."""

    def decide(
        tuner: Tuner, window: LoadWindow, budget: WorkerBudget
    ) -> tuple[Tuner, TuningDecision]:
        seen.append(window)
        return attrs.evolve(tuner, settled=True), TuningDecision(HOLD, "settled")

    return decide


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_a_settled_tuner_measures_a_starving_loop_over_half_a_second(
    where: dict[str, Any],
) -> None:
    # The loop starves (9 of each 10 ms waited), but the policy has settled: it has nothing to
    # do quickly, so windows are half a second (51 batches) again after the first 8 batches,
    # not 16 batches each with /proc read for every worker.
    seen: list[LoadWindow] = []
    loader = _on_a_loop_clock(where, _settling(seen), step=0.001, wait=0.009)
    list(loader)
    assert [window.batches for window in seen] == [8] + [51] * (len(seen) - 1)
    assert len(seen) >= 3


def _footprints_read(
    monkeypatch: pytest.MonkeyPatch, resident: int, available: int
) -> tuple[list[float], AutoTuning]:
    """The moments the workers' footprint (100 MB each) was read over 10 s of the tuner's
    clock, their resident size `resident`, `available` bytes of memory as the loader began;
    and the tuning the loader reported."""
    clock = _LoopClock(step=0.001, wait=0.009)
    read_at: list[float] = []

    def footprint(executor: Any) -> int | None:
        read_at.append(clock.now)
        return 10**8

    monkeypatch.setattr(autotune, "_largest_footprint", footprint)
    monkeypatch.setattr(autotune, "_largest_resident", lambda executor: resident)
    loader = statecore.DataLoader(
        Numbers(2000),
        batch_size=2,
        num_workers="auto",
        executor="mp",
        multiprocessing_context="fork",
    )
    loader._autotuner = AutoTuner(
        16, cpus=2, decide=_scripted([]), clock=clock, available_memory=available
    )
    list(loader)
    tuning = loader.stats().tuning
    assert tuning is not None
    return read_at, tuning


def test_the_workers_footprint_is_read_at_most_every_few_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Reading a worker's PSS walks its page tables (milliseconds a worker): over 10 s of the
    # tuner's clock in 16-batch windows (0.16 s each), it is read every MEMORY_SECONDS, not
    # every few windows (resident sizes that leave the budget short of the slots: read).
    read_at, _ = _footprints_read(monkeypatch, resident=10**15, available=10**10)
    assert len(read_at) >= 2
    gaps = [later - earlier for earlier, later in itertools.pairwise(read_at)]
    assert min(gaps) >= autotune.MEMORY_SECONDS


def test_the_footprint_is_read_once_while_resident_sizes_say_the_budget_holds_every_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 10 GB available, half of it the budget: 25 workers at 200 MB resident, over the 16
    # slots. The page-table walk after the first window is the only one.
    read_at, tuning = _footprints_read(monkeypatch, resident=2 * 10**8, available=10**10)
    assert len(read_at) == 1
    assert tuning.memory == 25


def test_the_footprint_is_read_again_where_resident_sizes_say_the_budget_may_bind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At 400 MB resident the budget holds 12 workers by that bound, under the 16 slots: the
    # proportional size decides (50 workers of 100 MB), read every few seconds.
    read_at, tuning = _footprints_read(monkeypatch, resident=4 * 10**8, available=10**10)
    assert len(read_at) >= 2
    assert tuning.memory == 50


def test_the_memory_budget_is_measured_on_worker_processes() -> None:
    loader = _auto(Numbers(200), _scripted([]), batch_size=2, executor="mp")
    list(loader)
    tuning = loader.stats().tuning
    assert tuning is not None
    # Half the memory available over the largest worker's proportional set size: a count.
    assert tuning.memory is not None and tuning.memory >= 1


def test_worker_threads_are_not_counted_against_the_memory_budget() -> None:
    loader = _auto(Numbers(200), _scripted([]), batch_size=2, executor="thread")
    list(loader)
    tuning = loader.stats().tuning
    assert tuning is not None and tuning.memory is None


class _Draws(Dataset):  # type: ignore[type-arg]
    """Item i: [i, a draw from `random`, one from torch, one from numpy], as an augmentation
    draws: from the worker's own generators in a worker thread, the process-wide ones else."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, index: int) -> list[float]:
        import random

        import numpy

        own = getattr(get_worker_info(), "rng", None)
        if own is not None:
            return [
                index,
                own.random_generator.random(),
                torch.rand(1, generator=own.torch_generator).item(),
            ]
        return [index, random.random(), torch.rand(1).item(), float(numpy.random.rand())]


def _drawn(loader: statecore.DataLoader[Any]) -> list[list[list[float]]]:
    return [[[float(x) for x in column] for column in batch] for batch in loader]


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_an_auto_loader_seeds_per_batch_so_its_draws_are_any_fixed_counts(
    where: dict[str, Any],
) -> None:
    # Left to itself (seeding=None), an auto loader seeds each batch from its position: while
    # the tuner adds and retires workers, the random draws are those of a fixed count seeding
    # per batch.
    def options() -> dict[str, Any]:
        return {"batch_size": 2, "generator": torch.Generator().manual_seed(7), **where}

    moves = [ADD, ADD, RETIRE, ADD]
    tuned = _drawn(_auto(_Draws(), _scripted(moves), **options()))
    fixed = _drawn(statecore.DataLoader(_Draws(), num_workers=3, seeding="per-batch", **options()))
    per_worker = _drawn(_auto(_Draws(), _scripted(moves), seeding="per-worker", **options()))
    assert tuned == fixed
    assert per_worker != fixed  # what the default spares the user


def test_an_auto_loader_keeps_torchs_seeds_when_told_and_says_what_to_pin() -> None:
    told = statecore.DataLoader(Numbers(8), num_workers="auto", executor="thread")
    kept = statecore.DataLoader(
        Numbers(8), num_workers="auto", executor="thread", seeding="per-worker"
    )
    assert told._seeding_in_force() == "per-batch"
    assert kept._seeding_in_force() == "per-worker"
