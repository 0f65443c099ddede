"""Checkpoints at the edges of an iterator's life: after `break`, at an epoch's end, after a
resume, in a pickled loader.

Each test compares a resumed loader with an uninterrupted run of the same configuration.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from _checkpoints import roundtrip, run_to_end, take
from _datasets import Numbers, StatefulIterator
from _side_by_side import WORKERS, as_lists

from statecore import DataLoader, Phase

RUNS = [
    pytest.param("inline", 0, id="inline"),
    pytest.param("mp", 2, id="mp-2"),
]


def seeded(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def shuffled(executor: str, workers: int, **options: Any) -> DataLoader[Any]:
    options.setdefault("generator", seeded())
    return DataLoader(
        Numbers(20), batch_size=2, shuffle=True, executor=executor, num_workers=workers, **options
    )


# --- defect 1: break, then save -----------------------------------------------------------------


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_a_state_taken_after_break_resumes_the_rest_of_the_epoch(
    executor: str, workers: int
) -> None:
    whole = run_to_end(iter(shuffled(executor, workers)))
    original = shuffled(executor, workers)
    for step, _ in enumerate(original):
        if step == 3:
            break
    # The for loop's iterator is unreferenced now; the state still describes its epoch.
    state = roundtrip(original.state_dict())
    resumed = shuffled(executor, workers, generator=seeded(99))
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == whole[4:]


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_a_new_iter_replaces_the_dropped_iterators_position(executor: str, workers: int) -> None:
    original = shuffled(executor, workers)
    for step, _ in enumerate(original):
        if step == 3:
            break
    iterator = iter(original)
    next(iterator)
    assert original.state_dict()["progress"]["done"] == 1


# --- defect 4: a sampler that yields more than its len() ---------------------------------------


class LongerThanItSays(torch.utils.data.Sampler[int]):
    """Yields 0..11 and says it has 5: torch iterates such a sampler to its end."""

    def __iter__(self) -> Any:
        return iter(range(12))

    def __len__(self) -> int:
        return 5


def _resumed_past(taken: int, executor: str, workers: int) -> tuple[dict[str, Any], list[Any]]:
    """A state of a loader whose sampler yields more than its len() says, taken after `taken`
    batches, and what a fresh loader resumed from it hands over."""

    def build() -> DataLoader[Any]:
        return DataLoader(
            Numbers(20), sampler=LongerThanItSays(), executor=executor, num_workers=workers
        )

    iterator = iter(original := build())
    for _ in range(taken):
        next(iterator)
    state = roundtrip(original.state_dict())
    resumed = build()
    resumed.load_state_dict(state)
    return state, run_to_end(iter(resumed))


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_a_sampler_longer_than_its_len_resumes_what_it_has_left(
    executor: str, workers: int
) -> None:
    # every batch len() promised, and the sampler has more
    state, rest = _resumed_past(5, executor, workers)
    assert state["complete"] is False
    assert rest == [[i] for i in range(5, 12)]


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_a_state_taken_past_a_samplers_len_is_accepted_and_resumes(
    executor: str, workers: int
) -> None:
    # Positions beyond len() are legitimate for a sampler that yields more than it says: only
    # torch's own samplers, which yield exactly len(), bound them when a state is loaded.
    assert _resumed_past(7, executor, workers)[1] == [[i] for i in range(7, 12)]


# --- torchdata's end of an epoch ----------------------------------------------------------------


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_a_state_taken_at_the_last_batch_ends_that_epoch_empty_with_a_warning(
    executor: str, workers: int
) -> None:
    original = shuffled(executor, workers)
    for _ in original:
        state = roundtrip(original.state_dict())  # the last one: after the last batch
    second = run_to_end(iter(original))

    resumed = shuffled(executor, workers, generator=seeded(1))
    resumed.load_state_dict(state)
    with pytest.warns(UserWarning, match="yields no batch"):
        assert run_to_end(iter(resumed)) == []
    assert run_to_end(iter(resumed)) == second


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_a_state_taken_after_the_for_loop_resumes_the_next_epoch_in_full(
    executor: str, workers: int
) -> None:
    original = shuffled(executor, workers)
    run_to_end(iter(original))
    state = roundtrip(original.state_dict())
    second = run_to_end(iter(original))
    resumed = shuffled(executor, workers, generator=seeded(1))
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == second


# --- defects 2 and 7: the random streams after a resume -----------------------------------------


class Seeded(torch.utils.data.Dataset[tuple[int, int]]):
    """Item i: i and the seed of the worker that loaded it (-1 in the main process)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        return index, -1 if info is None else info.seed


def on_global(executor: str, workers: int, persistent: bool) -> DataLoader[Any]:
    """Shuffled from torch's global generator, the most common setup."""
    return DataLoader(
        Seeded(),
        batch_size=2,
        shuffle=True,
        executor=executor,
        num_workers=workers,
        persistent_workers=persistent,
    )


PERSISTENT = [
    pytest.param("inline", 0, False, id="inline"),
    pytest.param("mp", 2, False, id="mp-2"),
    pytest.param("mp", 2, True, id="mp-2-persistent"),
]


@WORKERS
@pytest.mark.parametrize(("executor", "workers", "persistent"), PERSISTENT)
@pytest.mark.parametrize("epoch", [0, 1])
def test_after_a_mid_epoch_resume_every_random_stream_is_the_uninterrupted_runs(
    executor: str, workers: int, persistent: bool, epoch: int
) -> None:
    torch.manual_seed(11)
    uninterrupted = on_global(executor, workers, persistent)
    expected: list[Any] = []
    for number in range(3):
        if number == epoch:
            program_at_iter = torch.get_rng_state()  # where the resumed program stands
        expected += [run_to_end(iter(uninterrupted)), torch.rand(3).tolist()]

    torch.manual_seed(11)
    original = on_global(executor, workers, persistent)
    got: list[Any] = []
    for _ in range(epoch):
        got += [run_to_end(iter(original)), torch.rand(3).tolist()]
    iterator = iter(original)
    before = [next(iterator) for _ in range(2)]
    state = roundtrip(original.state_dict())
    del iterator

    # A fresh program that seeds as the original did, and resumes.
    torch.set_rng_state(program_at_iter)
    resumed = on_global(executor, workers, persistent)
    resumed.load_state_dict(state)
    got += [run_to_end(before) + run_to_end(iter(resumed)), torch.rand(3).tolist()]
    for _ in range(epoch + 1, 3):
        got += [run_to_end(iter(resumed)), torch.rand(3).tolist()]
    assert got == expected


@WORKERS
@pytest.mark.parametrize("own_generator", [False, True])
def test_persistent_workers_resumed_between_epochs_run_the_next_epoch_as_the_original(
    own_generator: bool,
) -> None:
    def build() -> DataLoader[Any]:
        return DataLoader(
            Seeded(),
            batch_size=2,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            generator=seeded(3) if own_generator else None,
        )

    torch.manual_seed(4)
    original = build()
    run_to_end(iter(original))
    state = roundtrip(original.state_dict())  # after the StopIteration
    program = torch.get_rng_state()
    expected = [run_to_end(iter(original)), run_to_end(iter(original)), torch.rand(3).tolist()]

    torch.set_rng_state(program)  # a program that restores its own random state
    resumed = build()
    resumed.load_state_dict(state)
    got = [run_to_end(iter(resumed)), run_to_end(iter(resumed)), torch.rand(3).tolist()]
    assert got == expected


def readable(state: dict[str, Any]) -> dict[str, Any]:
    """The state with its generator states shortened to a digest: a failure prints legibly."""
    shown = dict(state)
    shown["rng"] = {
        name: None if value is None else hashlib.sha1(value.encode()).hexdigest()[:12]
        for name, value in state["rng"].items()
    }
    return shown


def fit(
    loader: DataLoader[Any], epochs: int, limit: int, resumed_at: int = 0
) -> tuple[list[Any], list[dict[str, Any]], dict[str, Any]]:
    """Lightning's fit loop: one iter() per epoch, `limit` batches of it (the loader's epoch is
    left unfinished, as limit_train_batches leaves it), after each batch a draw of the training
    code's from torch's global generator (its dropout) and the loader's state saved.

    `resumed_at`: the first epoch goes on from that batch, on the iter() that follows a
    load_state_dict(), as Lightning's first epoch after a restart does. Returns what the
    training code saw and drew, the states (legible), and the last state as saved.
    """
    seen: list[Any] = []
    states: list[dict[str, Any]] = []
    last: dict[str, Any] = {}
    for epoch in range(epochs):
        iterator = iter(loader)
        for _ in range(resumed_at if epoch == 0 else 0, limit):
            seen.append((as_lists(next(iterator)), torch.rand(2).tolist()))
            last = roundtrip(loader.state_dict())
            states.append(readable(last))
    return seen, states, last


@WORKERS
@pytest.mark.parametrize(("executor", "workers", "persistent"), PERSISTENT)
@pytest.mark.parametrize("saved_at", [2, 4])
def test_resumed_as_lightning_resumes_every_random_stream_is_the_uninterrupted_runs(
    executor: str, workers: int, persistent: bool, saved_at: int
) -> None:
    torch.manual_seed(5)
    expected_seen, expected_states, _ = fit(
        on_global(executor, workers, persistent), epochs=3, limit=4
    )

    torch.manual_seed(5)
    seen, states, checkpoint = fit(
        on_global(executor, workers, persistent), epochs=1, limit=saved_at
    )
    # The restarted program does not restore torch's global generator (Lightning does not):
    # the loader's state puts it back where it stood at the checkpoint.
    torch.manual_seed(999)
    resumed = on_global(executor, workers, persistent)
    resumed.load_state_dict(checkpoint)
    more_seen, more_states, _ = fit(resumed, epochs=3, limit=4, resumed_at=saved_at)
    # The batches (their order, their workers' seeds) and the training code's draws; and
    # every state saved after the resume, the later epochs' base seeds and starts included.
    assert seen + more_seen == expected_seen
    assert states + more_states == expected_states


@pytest.mark.parametrize("taken", [0, 1])
def test_the_global_generator_goes_on_as_the_originals_from_a_state_taken_before_any_batch(
    taken: int,
) -> None:
    # Loading in the calling thread, the sampler draws its seed from the global generator on
    # the epoch's first batch: a state taken before it, the original's draw is still to come.
    torch.manual_seed(1)
    original = on_global("inline", 0, persistent=False)
    iterator = iter(original)
    take(iterator, taken)
    state = roundtrip(original.state_dict())
    rest = run_to_end(iterator)
    original_global = torch.get_rng_state()

    torch.manual_seed(99)
    resumed = on_global("inline", 0, persistent=False)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == rest
    assert torch.equal(torch.get_rng_state(), original_global)


def in_order_in_process() -> tuple[DataLoader[Any], list[Any], dict[str, Any]]:
    """A loader whose batches draw nothing random: its sampler is sequential, and no worker
    is seeded. Returns it two batches into its epoch, the rest of that epoch, and its state."""
    loader = DataLoader(Numbers(10), batch_size=2)
    iterator = iter(loader)
    take(iterator, 2)
    state = roundtrip(loader.state_dict())
    return loader, run_to_end(iterator), state


def test_a_state_of_batches_that_draw_nothing_holds_nothing_of_the_global_generator() -> None:
    # Two programs whose global streams differ (Lightning compares a restarted run's states
    # with the uninterrupted run's): the same batches, the same state.
    torch.manual_seed(1)
    _, _, first = in_order_in_process()
    torch.manual_seed(2)
    _, _, second = in_order_in_process()
    assert first["base_seed"] is None
    assert first["rng"] == {"epoch_start": None, "now": None}
    assert first == second


def test_a_state_counts_no_epochs_so_a_fresh_loader_gives_the_same_at_the_same_point() -> None:
    # Lightning restarted from an epoch's end builds a fresh loader and loads no state into it,
    # then compares its states with those of the loader that ran every epoch.
    _, _, fresh = in_order_in_process()
    loader, _, _ = in_order_in_process()
    run_to_end(iter(loader))
    iterator = iter(loader)
    take(iterator, 2)
    assert roundtrip(loader.state_dict()) == fresh


def test_a_state_of_batches_that_draw_nothing_resumes_and_leaves_the_global_generator_alone() -> (
    None
):
    _, rest, state = in_order_in_process()
    resumed = DataLoader(Numbers(10), batch_size=2)
    resumed.load_state_dict(state)
    torch.manual_seed(3)
    assert run_to_end(iter(resumed)) == rest
    # The program's stream moved on by what torch's iter() draws from it (its base seed).
    resumed_program = torch.get_rng_state()
    torch.manual_seed(3)
    iter(torch.utils.data.DataLoader(Numbers(10), batch_size=2))
    assert torch.equal(torch.get_rng_state(), resumed_program)


# --- snapshot_every_n_steps=0 -------------------------------------------------------------------


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_snapshot_every_0_steps_sends_no_state_and_resumes_by_fast_forwarding(
    executor: str, workers: int
) -> None:
    def build() -> DataLoader[Any]:
        return DataLoader(
            StatefulIterator(30),
            batch_size=2,
            executor=executor,
            num_workers=workers,
            snapshot_every_n_steps=0,
        )

    original = build()
    iterator = iter(original)
    for _ in range(5):
        next(iterator)
    state = roundtrip(original.state_dict())
    assert all(worker["state"] is None for worker in state["workers"])
    after = run_to_end(iterator)
    resumed = build()
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == after


@WORKERS
@pytest.mark.parametrize(("executor", "workers", "persistent"), PERSISTENT)
@pytest.mark.parametrize("epochs_before", [0, 1])
def test_a_state_between_epochs_resumes_the_next_epoch_drawn_from_the_global_as_the_original(
    executor: str, workers: int, persistent: bool, epochs_before: int
) -> None:
    torch.manual_seed(21)
    original = on_global(executor, workers, persistent)
    for _ in range(epochs_before):
        run_to_end(iter(original))
    state = roundtrip(original.state_dict())  # before the first iter(), or after a for loop
    expected = [run_to_end(iter(original))]
    original_global = torch.get_rng_state()

    torch.manual_seed(5)  # a program that neither restores nor seeds its stream as before
    resumed = on_global(executor, workers, persistent)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == expected[0]
    # The global generator was put back where the state found it, and the epoch drew from it
    # what the original's did: the program goes on with the original's stream.
    assert torch.equal(torch.get_rng_state(), original_global)


# --- a dataset state that the dataset goes on changing -------------------------------------------


class LiveState(torch.utils.data.IterableDataset[int]):
    """Its state_dict() hands out the very dict it goes on updating, as many datasets do."""

    def __init__(self) -> None:
        self.position = {"next": 0}

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        mine = range(worker, 40, workers)
        while self.position["next"] < len(mine):
            item = mine[self.position["next"]]
            self.position["next"] += 1
            yield item

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = dict(state["position"])


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)  # threads share one dataset object
def test_a_dataset_state_changed_after_its_batch_is_kept_as_it_was_at_that_batch(
    executor: str, workers: int
) -> None:
    def build() -> DataLoader[Any]:
        return DataLoader(LiveState(), batch_size=1, executor=executor, num_workers=workers)

    original = build()
    iterator = iter(original)
    for _ in range(7):
        next(iterator)
    state = roundtrip(original.state_dict())
    after = run_to_end(iterator)
    resumed = build()
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == after


class BreaksWhenAsked(torch.utils.data.Sampler[int]):
    """A stateful sampler whose state_dict() raises once `broken` is set."""

    def __init__(self) -> None:
        self.broken = False

    def __iter__(self) -> Any:
        return iter(range(10))

    def __len__(self) -> int:
        return 10

    def state_dict(self) -> dict[str, Any]:
        if self.broken:
            raise RuntimeError("state_dict is broken")
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@WORKERS
def test_an_iterator_stops_its_workers_even_when_its_position_cannot_be_kept() -> None:
    sampler = BreaksWhenAsked()
    iterator = iter(DataLoader(Numbers(10), sampler=sampler, num_workers=2))
    list(iterator)  # at the end, its position asks the sampler's state_dict()
    driver = iterator._driver  # type: ignore[attr-defined]
    sampler.broken = True
    with pytest.raises(RuntimeError, match="broken"):
        iterator._shutdown()  # type: ignore[attr-defined]
    assert driver.state.phase is Phase.CLOSED
