"""statecore.DataLoader has torch's DataLoader interface: signature, validation, len, helpers.

Where statecore adds something (the `executor` argument, `multiprocess` contexts) the tests say
what it must do; everywhere else the specification is whatever torch does for the same call.
"""

from __future__ import annotations

import inspect
import multiprocessing
import re
import typing
import warnings
from collections.abc import Callable
from typing import Any

import multiprocess
import pytest
import torch
import torch.utils.data
from _datasets import (
    GrowingBatches,
    Numbers,
    ShardedRange,
    SizedIterable,
    WorkerInfoProbe,
    record_init_draws,
    sum_and_items,
)
from _side_by_side import LOADERS, WORKERS, as_lists

import statecore
from statecore.executors import Launch
from statecore.executors._inline import InlineExecutor

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


# --- the class and its signature -----------------------------------------------------------------


def test_signature_is_torchs_plus_keyword_only_executor_snapshot_option_and_trace() -> None:
    ours = inspect.signature(statecore.DataLoader.__init__).parameters
    theirs = inspect.signature(torch.utils.data.DataLoader.__init__).parameters
    extras = [
        "executor",
        "snapshot_every_n_steps",
        "trace",
        "worker_restarts",
        "worker_timeout",
        "seeding",
    ]
    assert list(ours) == [*theirs, *extras]
    assert all(ours[name].kind is inspect.Parameter.KEYWORD_ONLY for name in extras)
    assert (ours["worker_restarts"].default, ours["worker_timeout"].default) == (0, 0)
    assert ours["seeding"].default is None  # torch's seeding: see docs/checkpointing.md, "Seeds"
    for name, parameter in theirs.items():
        assert (ours[name].kind, ours[name].default) == (parameter.kind, parameter.default), name
    executor = ours["executor"]
    assert executor.kind is inspect.Parameter.KEYWORD_ONLY
    assert executor.default is None
    # torchdata's StatefulDataLoader: keyword-only, default 1.
    snapshots = ours["snapshot_every_n_steps"]
    assert (snapshots.kind, snapshots.default) == (inspect.Parameter.KEYWORD_ONLY, 1)
    # None: the environment decides (STATECORE_TRACE), see docs/profiling.md.
    trace = ours["trace"]
    assert (trace.kind, trace.default) == (inspect.Parameter.KEYWORD_ONLY, None)


def test_loader_is_a_torch_dataloader() -> None:
    loader = statecore.DataLoader(Numbers(4))
    assert isinstance(loader, torch.utils.data.DataLoader)


def test_loader_attributes_equal_torchs() -> None:
    args: dict[str, Any] = {"batch_size": 3, "shuffle": True, "drop_last": True}
    ours = statecore.DataLoader(Numbers(10), **args)
    theirs = torch.utils.data.DataLoader(Numbers(10), **args)
    for name in ("batch_size", "drop_last", "num_workers", "timeout", "prefetch_factor"):
        assert getattr(ours, name) == getattr(theirs, name), name
    # shuffle=True: a RandomSampler of ours, drawing torch's order (test_permutation_sampler.py)
    assert isinstance(ours.sampler, type(theirs.sampler))
    assert type(ours.batch_sampler) is type(theirs.batch_sampler)
    assert ours.collate_fn is theirs.collate_fn


# --- validation ----------------------------------------------------------------------------------
# Each row: keyword arguments that torch refuses. statecore must refuse them the same way.

BAD_ARGUMENTS = [
    pytest.param(lambda: {"dataset": Numbers(5), "num_workers": -1}, id="negative-num-workers"),
    pytest.param(lambda: {"dataset": Numbers(5), "timeout": -1}, id="negative-timeout"),
    pytest.param(
        lambda: {"dataset": Numbers(5), "batch_size": 2, "batch_sampler": GrowingBatches(5)},
        id="batch-sampler-with-batch-size",
    ),
    pytest.param(
        lambda: {"dataset": Numbers(5), "shuffle": True, "batch_sampler": GrowingBatches(5)},
        id="batch-sampler-with-shuffle",
    ),
    pytest.param(
        lambda: {"dataset": Numbers(5), "sampler": [0, 1], "batch_sampler": GrowingBatches(5)},
        id="batch-sampler-with-sampler",
    ),
    pytest.param(
        lambda: {"dataset": Numbers(5), "drop_last": True, "batch_sampler": GrowingBatches(5)},
        id="batch-sampler-with-drop-last",
    ),
    pytest.param(
        lambda: {"dataset": Numbers(5), "sampler": [0, 1], "shuffle": True},
        id="sampler-with-shuffle",
    ),
    pytest.param(
        lambda: {"dataset": Numbers(5), "persistent_workers": True},
        id="persistent-workers-without-workers",
    ),
    pytest.param(
        lambda: {"dataset": Numbers(5), "prefetch_factor": 2},
        id="prefetch-factor-without-workers",
    ),
    pytest.param(
        lambda: {"dataset": Numbers(5), "num_workers": 2, "prefetch_factor": -1},
        id="negative-prefetch-factor",
    ),
    pytest.param(
        lambda: {"dataset": Numbers(5), "num_workers": 2, "multiprocessing_context": "bogus"},
        id="unknown-start-method",
    ),
    pytest.param(
        lambda: {"dataset": Numbers(5), "multiprocessing_context": "fork"},
        id="start-method-without-workers",
    ),
    pytest.param(
        lambda: {"dataset": Numbers(5), "num_workers": 2, "multiprocessing_context": 42},
        id="context-of-the-wrong-type",
    ),
    pytest.param(
        lambda: {"dataset": Numbers(5), "multiprocessing_context": multiprocessing.get_context()},
        id="context-object-without-workers",
    ),
    pytest.param(lambda: {"dataset": ShardedRange(5), "shuffle": True}, id="iterable-with-shuffle"),
    pytest.param(lambda: {"dataset": ShardedRange(5), "sampler": [0]}, id="iterable-with-sampler"),
    pytest.param(
        lambda: {"dataset": ShardedRange(5), "batch_sampler": [[0]]},
        id="iterable-with-batch-sampler",
    ),
    pytest.param(
        lambda: {"dataset": Numbers(5), "batch_size": None, "drop_last": True},
        id="drop-last-without-batching",
    ),
    pytest.param(lambda: {"dataset": Numbers(5), "batch_size": 0}, id="zero-batch-size"),
    pytest.param(lambda: {"dataset": Numbers(5), "batch_size": 2.5}, id="fractional-batch-size"),
    pytest.param(lambda: {"dataset": Numbers(5), "drop_last": "yes"}, id="drop-last-not-a-bool"),
]


def construction_error(loader_class: type, kwargs: dict[str, Any]) -> BaseException:
    with pytest.raises(Exception) as raised:
        loader_class(**kwargs)
    return raised.value


@pytest.mark.parametrize("kwargs", BAD_ARGUMENTS)
def test_bad_arguments_are_refused_with_torchs_error(kwargs: Callable[[], dict[str, Any]]) -> None:
    expected = construction_error(torch.utils.data.DataLoader, kwargs())
    got = construction_error(statecore.DataLoader, kwargs())
    assert (type(got), str(got)) == (type(expected), str(expected))


@pytest.mark.parametrize(
    ("attribute", "value"),
    [("batch_size", 4), ("dataset", Numbers(3)), ("drop_last", True), ("sampler", [0])],
)
def test_setting_a_fixed_attribute_after_construction_fails_like_torch(
    attribute: str, value: Any
) -> None:
    errors = []
    for loader_class in (torch.utils.data.DataLoader, statecore.DataLoader):
        loader = loader_class(Numbers(10), batch_size=2)
        with pytest.raises(ValueError) as raised:
            setattr(loader, attribute, value)
        errors.append(str(raised.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("loader_class", LOADERS)
def test_timeout_without_workers_fails_when_iterated(loader_class: type) -> None:
    # torch accepts the argument but refuses to start an in-process iterator with it.
    loader = loader_class(Numbers(5), timeout=3)
    with pytest.raises(AssertionError, match="timeout == 0"):
        iter(loader)


# --- len() ---------------------------------------------------------------------------------------

LENGTHS = [
    pytest.param(Numbers(10), {}, id="map-defaults"),
    pytest.param(Numbers(10), {"batch_size": 3}, id="map-b3"),
    pytest.param(Numbers(10), {"batch_size": 3, "drop_last": True}, id="map-b3-drop"),
    pytest.param(Numbers(9), {"batch_size": 3, "drop_last": True}, id="map-b3-drop-even"),
    pytest.param(Numbers(10), {"batch_size": None}, id="map-unbatched"),
    pytest.param(Numbers(10), {"batch_sampler": GrowingBatches(10)}, id="batch-sampler"),
    pytest.param(Numbers(10), {"sampler": [1, 2, 3, 4, 5], "batch_size": 2}, id="list-sampler"),
    pytest.param(SizedIterable(10, 10), {"batch_size": 3}, id="iterable-b3"),
    pytest.param(SizedIterable(10, 10), {"batch_size": 3, "drop_last": True}, id="iterable-drop"),
    pytest.param(SizedIterable(10, 10), {"batch_size": None}, id="iterable-unbatched"),
    pytest.param(SizedIterable(10, 10), {"batch_size": 3, "num_workers": 2}, id="iterable-w2"),
    pytest.param(Numbers(10), {"batch_size": 4, "num_workers": 2}, id="map-w2"),
]


@pytest.mark.parametrize(("dataset", "kwargs"), LENGTHS)
def test_len_equals_torchs(dataset: Any, kwargs: dict[str, Any]) -> None:
    assert len(statecore.DataLoader(dataset, **kwargs)) == len(
        torch.utils.data.DataLoader(dataset, **kwargs)
    )


def test_len_of_an_iterable_without_len_fails_like_torch() -> None:
    errors = []
    for loader_class in (torch.utils.data.DataLoader, statecore.DataLoader):
        with pytest.raises(TypeError) as raised:
            len(loader_class(ShardedRange(10)))
        errors.append(str(raised.value))
    assert errors[0] == errors[1]


def yielded_and_warned(loader: Any) -> tuple[list[Any], list[str]]:
    """Take len(loader), then load everything; return the batches and the warnings given."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", "This DataLoader will create")
        len(loader)
        batches = as_lists(list(loader))
    return batches, [str(warning.message) for warning in caught]


@pytest.mark.parametrize("num_workers", [0, 2])
@WORKERS
def test_more_samples_than_the_reported_length_warns_like_torch(num_workers: int) -> None:
    dataset = SizedIterable(13, 5)  # one dataset for both: the warning names it

    def loader(loader_class: type) -> Any:
        return loader_class(dataset, batch_size=2, num_workers=num_workers)

    expected = yielded_and_warned(loader(torch.utils.data.DataLoader))
    got = yielded_and_warned(loader(statecore.DataLoader))
    assert got == expected
    assert any("was reported to be 5" in message for message in got[1])


def profiled_labels(loader: Any) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in loader:
            pass
    return [event.name for event in profiler.events() if event.name.startswith("enumerate(")]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_under_the_profiler_every_batch_is_labelled_as_torch_labels_it() -> None:
    theirs = profiled_labels(torch.utils.data.DataLoader(range(6), batch_size=2))
    ours = profiled_labels(statecore.DataLoader(range(6), batch_size=2))
    assert len(ours) == len(theirs) == 4  # three batches, and the call that ends the epoch
    assert set(ours) == {"enumerate(DataLoader)#_Iterator.__next__"}


# --- executors -----------------------------------------------------------------------------------


def test_inline_executor_with_workers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"executor='inline'.*num_workers=0.*num_workers=4"):
        statecore.DataLoader(Numbers(5), num_workers=4, executor="inline")


def test_mp_executor_without_workers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"executor='mp'.*num_workers > 0.*num_workers=0"):
        statecore.DataLoader(Numbers(5), executor="mp")


def test_unknown_executor_is_refused_with_the_available_names() -> None:
    with pytest.raises(ValueError, match="unknown executor 'threads'") as raised:
        statecore.DataLoader(Numbers(5), executor="threads")
    assert re.search(r"\binline\b", str(raised.value))
    assert re.search(r"\bmp\b", str(raised.value))


def test_executor_that_is_neither_a_name_nor_a_factory_is_refused() -> None:
    with pytest.raises(TypeError, match="executor must be a name"):
        statecore.DataLoader(Numbers(5), executor=3)  # type: ignore[arg-type]


def test_inline_executor_loads_like_torch_without_workers() -> None:
    loader = statecore.DataLoader(Numbers(10), batch_size=3, executor="inline")
    expected = torch.utils.data.DataLoader(Numbers(10), batch_size=3)
    assert as_lists(list(loader)) == as_lists(list(expected))


@WORKERS
def test_mp_executor_loads_like_torch_with_workers() -> None:
    loader = statecore.DataLoader(Numbers(10), batch_size=3, num_workers=2, executor="mp")
    expected = torch.utils.data.DataLoader(Numbers(10), batch_size=3, num_workers=2)
    assert as_lists(list(loader)) == as_lists(list(expected))


def test_executor_factory_is_given_the_launch_and_does_the_loading() -> None:
    launches: list[Launch] = []

    def factory(launch: Launch) -> InlineExecutor:
        launches.append(launch)
        return InlineExecutor(launch)

    loader = statecore.DataLoader(Numbers(7), batch_size=3, executor=factory)
    assert as_lists(list(loader)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert as_lists(list(loader)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert len(launches) == 2  # one per epoch, as torch makes one iterator per epoch
    assert launches[0].num_workers == 1
    assert launches[0].setup.dataset is loader.dataset


# --- multiprocessing contexts --------------------------------------------------------------------


@pytest.mark.parametrize(
    "context",
    [
        pytest.param(lambda: multiprocess.get_context("fork"), id="multiprocess"),
        pytest.param(lambda: multiprocessing.get_context("fork"), id="stdlib"),
        pytest.param(lambda: "fork", id="name"),
    ],
)
@WORKERS
def test_multiprocessing_context_may_be_a_context_of_either_package(
    context: Callable[[], Any],
) -> None:
    loader = statecore.DataLoader(
        Numbers(10), batch_size=3, num_workers=2, multiprocessing_context=context()
    )
    assert as_lists(list(loader)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert loader.multiprocessing_context.get_start_method() == "fork"


# --- get_worker_info -----------------------------------------------------------------------------


def test_get_worker_info_is_none_in_the_main_process() -> None:
    assert statecore.get_worker_info() is None


def test_get_worker_info_is_none_while_loading_in_process() -> None:
    loader = statecore.DataLoader(WorkerInfoProbe(), batch_size=None)
    assert as_lists(list(loader)) == [[None]]
    assert statecore.get_worker_info() is None


@WORKERS
def test_get_worker_info_in_workers_is_torchs_worker_info() -> None:
    def probe(loader_class: type) -> list[Any]:
        loader = loader_class(
            WorkerInfoProbe(),
            batch_size=None,
            num_workers=3,
            generator=torch.Generator().manual_seed(5),
        )
        return as_lists(list(loader))

    got = probe(statecore.DataLoader)
    assert got == probe(torch.utils.data.DataLoader)
    assert [info[:3] for info in got] == [[True, 0, 3], [True, 1, 3], [True, 2, 3]]
    assert all(info[4] for info in got)  # info.dataset is the worker's copy of the dataset
    assert statecore.get_worker_info() is None


# --- generics and rebuilding from attributes -----------------------------------------------------


def test_loader_class_is_generic_like_torchs() -> None:
    alias = statecore.DataLoader[int]
    assert typing.get_origin(alias) is statecore.DataLoader
    assert typing.get_args(alias) == (int,)


def test_every_argument_reaches_torchs_init_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # A framework that records the arguments of torch's __init__ rebuilds the loader by calling
    # its class with them: a positional argument there collides with a sampler it injects.
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    torch_init = torch.utils.data.DataLoader.__init__

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append((args, kwargs))
        torch_init(self, *args, **kwargs)

    monkeypatch.setattr(torch.utils.data.DataLoader, "__init__", recording_init)
    statecore.DataLoader(Numbers(5), 2, False, None, None, 0, None, executor="inline")
    [(args, kwargs)] = calls
    assert args == ()
    assert (kwargs["batch_size"], kwargs["shuffle"]) == (2, False)


REBUILT = {
    "batch_size": 3,
    "num_workers": 2,
    "collate_fn": sum_and_items,
    "drop_last": True,
    "timeout": 30.0,
    "worker_init_fn": record_init_draws,
    "multiprocessing_context": "spawn",
    "generator": None,
    "prefetch_factor": 3,
    "persistent_workers": True,
    "in_order": False,
    "executor": "thread",
}


def test_every_argument_is_kept_as_the_attribute_of_the_same_name() -> None:
    loader = statecore.DataLoader(Numbers(10), **REBUILT)
    for name, value in REBUILT.items():
        kept = getattr(loader, name)
        if name == "multiprocessing_context":
            kept = kept.get_start_method()
        assert kept == value, name


@WORKERS
def test_a_loader_rebuilt_from_its_attributes_keeps_its_executor() -> None:
    # What Lightning does with a loader it did not see built: read the __init__ parameters back
    # from the attributes of the same name, and bring a sampler of its own. (shuffle is not
    # kept, as in torch: it became the sampler.)
    arguments = dict(REBUILT, multiprocessing_context="fork", persistent_workers=False)
    arguments["in_order"] = True  # threads may finish out of order: compare like with like
    loader = statecore.DataLoader(Numbers(10), **arguments)
    own = {"shuffle", "sampler", "batch_sampler"}
    names = [name for name in inspect.signature(statecore.DataLoader).parameters if name not in own]
    rebuilt = statecore.DataLoader(**{name: getattr(loader, name) for name in names})
    assert rebuilt.executor == "thread"
    assert rebuilt.executor_factory is loader.executor_factory
    assert as_lists(list(rebuilt)) == as_lists(list(loader))


def test_setting_the_executor_after_construction_changes_what_loads() -> None:
    loader = statecore.DataLoader(Numbers(7), batch_size=3, num_workers=2)
    loader.executor = "thread"
    assert (
        loader.executor_factory
        is statecore.DataLoader(Numbers(7), num_workers=2, executor="thread").executor_factory
    )
    with pytest.raises(ValueError, match="executor='inline'"):
        loader.executor = "inline"
    assert loader.executor == "thread"  # a refused executor leaves the loader as it was


# --- arguments torch takes at face value ---------------------------------------------------------


@WORKERS
def test_num_workers_true_loads_with_one_worker_like_torch() -> None:
    def probe(loader_class: type) -> list[Any]:
        loader = loader_class(
            WorkerInfoProbe(),
            batch_size=None,
            num_workers=True,
            generator=torch.Generator().manual_seed(5),
        )
        return as_lists(list(loader))

    got = probe(statecore.DataLoader)
    assert got == probe(torch.utils.data.DataLoader)
    assert [info[:3] for info in got] == [[True, 0, 1]]


@pytest.mark.parametrize("loader_class", LOADERS)
def test_a_fractional_num_workers_is_refused_at_iter_like_torch(loader_class: type) -> None:
    loader = loader_class(Numbers(4), num_workers=2.5)
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        iter(loader)


@pytest.mark.parametrize("loader_class", LOADERS)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # torch's __del__
def test_prefetch_factor_zero_with_workers_fails_when_iterated(loader_class: type) -> None:
    loader = loader_class(Numbers(5), num_workers=2, prefetch_factor=0)
    with pytest.raises(AssertionError, match="prefetch_factor must be greater than 0"):
        iter(loader)


def returns_nothing(launch: Launch) -> Any:
    return None


def test_executor_factory_that_returns_no_executor_is_named_in_the_error() -> None:
    loader = statecore.DataLoader(Numbers(5), executor=returns_nothing)
    with pytest.raises(TypeError, match=r"executor factory returns_nothing returned None"):
        iter(loader)


def test_executor_factory_under_the_pin_stage_that_returns_no_executor_is_named() -> None:
    wrapped = statecore.executors.pinned(returns_nothing, pin=lambda batch: batch)
    loader = statecore.DataLoader(Numbers(5), executor=wrapped)
    with pytest.raises(TypeError, match=r"executor factory returns_nothing returned None"):
        iter(loader)
