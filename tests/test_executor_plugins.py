"""A third-party executor, registered the way a user's package would register it."""

from __future__ import annotations

import gc
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _launch import launch
from hypothesis import settings as Settings

import statecore
from statecore import Event, SendTask
from statecore.executors import (
    ENTRY_POINT_GROUP,
    Capabilities,
    Declared,
    Launch,
    PinnedExecutor,
    available,
    capabilities_of,
)
from statecore.executors._inline import InlineExecutor
from statecore.executors._mp import MultiprocessExecutor
from statecore.executors._protocol import replacer_of
from statecore.executors._registry import BUILT_IN, loads_in_process
from statecore.executors._thread.executor import ThreadExecutor
from statecore.models.kit import check_executor, matrix
from statecore.models.loader import Forwarding

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "executors.md"


@pytest.fixture
def acme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Install docs/executors.md's worked example as the package `acme_loading`."""
    code = re.search(r"```python\n(\"\"\"acme_loading.*?)```", GUIDE.read_text(), re.S)
    assert code is not None, "the guide's worked example is missing"
    (tmp_path / "acme_loading.py").write_text(code.group(1))
    info = tmp_path / "acme_loading-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-loading\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nacme = acme_loading:make_executor\n"
        "inline = acme_loading:make_executor\n"  # may not shadow a built-in
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "acme"
    sys.modules.pop("acme_loading", None)


def test_a_registered_executor_is_listed_by_name(acme: str) -> None:
    assert acme in available()
    assert {"inline", "mp", "thread"} <= set(available())


def test_a_registered_executor_loads_torchs_batches(acme: str) -> None:
    data = torch.arange(23)
    ours = [
        b.tolist() for b in statecore.DataLoader(data, batch_size=4, num_workers=3, executor=acme)
    ]
    theirs = [b.tolist() for b in torch.utils.data.DataLoader(data, batch_size=4, num_workers=0)]
    assert ours == theirs


def test_a_plugin_cannot_take_a_built_in_name(acme: str) -> None:
    loader = statecore.DataLoader(torch.arange(4), executor="inline")
    assert loader.executor_factory is BUILT_IN["inline"][0]


def test_a_misspelt_name_lists_the_registered_executors_too(acme: str) -> None:
    with pytest.raises(ValueError, match="acme, inline, mp, pinned, ray, thread"):
        statecore.DataLoader(torch.arange(4), num_workers=2, executor="acmee")


@pytest.mark.timeout(300)
def test_the_conformance_kit_passes_a_registered_executor(acme: str) -> None:
    # Every case of the matrix, and the Hypothesis machine with 3 drawn runs, not the kit's
    # default 10: the kit finds the executor by its registered name, which one run shows.
    machine = Settings(max_examples=3, stateful_step_count=6, deadline=None, derandomize=True)
    report = check_executor(acme, settings=machine)
    assert len(report.cases) == len(matrix(in_process=False))


class FailsToDispatch(ThreadExecutor):
    """The thread executor, except that it cannot give out a second task (a worker that cannot
    be started, say)."""

    shutdowns = 0

    def dispatch(self, command: SendTask) -> None:
        if command.task == 1:
            raise OSError("worker 1 could not be started")
        super().dispatch(command)

    def shutdown(self) -> None:
        FailsToDispatch.shutdowns += 1
        super().shutdown()


@pytest.mark.timeout(60)
def test_an_executor_that_cannot_carry_out_a_command_fails_the_loader_cleanly() -> None:
    FailsToDispatch.shutdowns = 0
    loader = statecore.DataLoader(range(8), num_workers=2, executor=FailsToDispatch)
    with pytest.raises(OSError, match="worker 1 could not be started"):
        iter(loader)
    # What was already running was stopped, and nothing the scheduler asked after the failure
    # (the next draw, the next task) was carried out: closing later finds nothing to do.
    assert FailsToDispatch.shutdowns == 1
    gc.collect()
    assert FailsToDispatch.shutdowns == 1


# --- what an executor declares -------------------------------------------------------------------


def test_the_registry_says_what_each_built_in_factory_declares() -> None:
    for name, (factory, in_process) in BUILT_IN.items():
        assert capabilities_of(factory).in_process == in_process, name
    assert capabilities_of(BUILT_IN["mp"][0]).poll_from_any_thread
    assert capabilities_of(BUILT_IN["thread"][0]).poll_from_any_thread
    assert not capabilities_of(BUILT_IN["inline"][0]).poll_from_any_thread
    # What an executor itself declares is read from the executor.
    for executor_class in (InlineExecutor, ThreadExecutor, MultiprocessExecutor, PinnedExecutor):
        assert capabilities_of(executor_class).confirms_answers, executor_class


def test_the_thread_executor_declares_it_replaces_workers_it_cannot_kill() -> None:
    for declarer in (BUILT_IN["thread"][0], ThreadExecutor):
        declared = capabilities_of(declarer)
        assert declared.replaces_workers and not declared.kills_stuck_workers, declarer
    assert not capabilities_of(BUILT_IN["inline"][0]).replaces_workers


class ClaimsToReplace(InlineExecutor):
    """Declares replaces_workers, and has neither replace() nor report()."""

    capabilities = Capabilities(in_process=True, replaces_workers=True)


def test_a_plugin_declaring_replaces_workers_without_the_methods_is_refused() -> None:
    with pytest.raises(TypeError, match=r"declares replaces_workers but lacks replace"):
        replacer_of(ClaimsToReplace(launch(list(range(4)), 1)))


def make_inline(launch: Launch) -> InlineExecutor:
    return InlineExecutor(launch)


def legacy_inline(launch: Launch) -> InlineExecutor:
    return InlineExecutor(launch)


legacy_inline.in_process = True  # type: ignore[attr-defined]


class Unconfirmed(Forwarding):
    """An executor as written before `Capabilities` and `confirm()`: it declares nothing, and
    sets an attribute `unconfirmed` to the answer it returns, which the driver once read and
    cleared."""

    capabilities = None  # type: ignore[assignment]  # declares nothing
    in_process = True

    def __init__(self, launch: Launch) -> None:
        super().__init__(InlineExecutor(launch))
        self.unconfirmed: Event | None = None

    def poll(self, timeout: float | None) -> Event | None:
        self.unconfirmed = self.inner.poll(timeout)
        self.inner.confirm()  # type: ignore[attr-defined]
        return self.unconfirmed


def test_an_object_declaring_nothing_gets_the_defaults() -> None:
    assert capabilities_of(make_inline) == Capabilities()
    assert capabilities_of(object()) == Capabilities()


def test_attributes_of_plugins_written_before_capabilities_still_declare() -> None:
    assert capabilities_of(legacy_inline) == Capabilities(in_process=True)
    assert loads_in_process(legacy_inline)
    loader = statecore.DataLoader(torch.arange(5), batch_size=2, executor=legacy_inline)
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4]]


def test_an_executor_written_for_the_attribute_unconfirmed_loads_as_one_that_does_not_confirm() -> (
    None
):
    assert capabilities_of(Unconfirmed) == Capabilities(in_process=True)
    loader = statecore.DataLoader(torch.arange(5), batch_size=2, executor=Unconfirmed)
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4]]


def test_a_factory_function_declares_through_declared() -> None:
    factory = Declared(make_inline, Capabilities(in_process=True, confirms_answers=True))
    assert capabilities_of(factory).in_process and loads_in_process(factory)
    loader = statecore.DataLoader(torch.arange(3), executor=factory)
    assert loader.loads_in_process
    assert [b.tolist() for b in loader] == [[0], [1], [2]]


def test_an_in_process_factory_with_workers_is_refused_as_a_named_one_is() -> None:
    factory = Declared(make_inline, Capabilities(in_process=True))
    with pytest.raises(ValueError, match=r"loads in the calling thread.*num_workers=2"):
        statecore.DataLoader(torch.arange(4), num_workers=2, executor=factory)


def test_a_factory_passed_as_it_is_and_not_in_process_follows_num_workers() -> None:
    without = statecore.DataLoader(torch.arange(4), executor=ThreadExecutor)
    assert without.loads_in_process  # one worker, loading as in-process loading does
    assert [b.tolist() for b in without] == [[0], [1], [2], [3]]
    with_workers = statecore.DataLoader(torch.arange(4), num_workers=2, executor=FailsToDispatch)
    assert not with_workers.loads_in_process
