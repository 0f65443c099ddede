"""The executor conformance kit: every built-in executor passes it, and it fails a broken one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _broken import Blanking, Misnumbering, Unstamped
from hypothesis import settings as Settings
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from statecore import ReplaceWorker, WorkerDied
from statecore.executors import pinned
from statecore.executors._inline import InlineExecutor
from statecore.executors._thread.executor import ThreadExecutor
from statecore.executors._worker import Mark
from statecore.models.conformance import ConformanceError, loads_in_process
from statecore.models.kit import (
    Case,
    check_executor,
    check_replacing,
    declares_replacing,
    matrix,
    replace_cases,
    run_case,
)

MANY_WORKERS = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture
def pinning_clones(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`Tensor.pin_memory` as a copy, so torch's own pin function runs without an accelerator."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *_: self.clone())
    yield


@pytest.mark.timeout(300)
@MANY_WORKERS
@pytest.mark.parametrize("name", ["inline", "mp", "thread"])
def test_every_built_in_executor_passes_the_kit(name: str) -> None:
    report = check_executor(name)  # raises ConformanceError on any difference from torch
    assert repr(name) in report.describe()
    # The replacement cases ran for those that declare they replace workers, and only those.
    replaces = name != "inline" and declares_replacing(name)
    assert report.replace_cases == (tuple(c.name for c in replace_cases()) if replaces else ())


def test_the_thread_and_mp_executors_declare_that_they_replace_workers() -> None:
    # So that the kit above runs the replacement cases on it (the mp executor's too).
    assert declares_replacing("thread")
    assert declares_replacing("mp")


class TellsTheLostOnesDeath(ThreadExecutor):
    """The thread executor, also reporting each lost incarnation's end under its own number, as
    a process executor may (the process it killed)."""

    def replace(self, command: ReplaceWorker, mark: Mark | None) -> None:
        lost = self.incarnations[command.worker]
        super().replace(command, mark)
        self._answer(WorkerDied(command.worker, None, -9, incarnation=lost))


@pytest.mark.timeout(120)
def test_the_replacement_cases_let_a_lost_incarnation_report_its_death_under_its_number() -> None:
    check_replacing(TellsTheLostOnesDeath)


@pytest.mark.timeout(120)
def test_the_replacement_cases_fail_a_replacement_started_under_another_number() -> None:
    with pytest.raises(ConformanceError, match=r"WorkerStarted\(worker=0, incarnation=2\).*never"):
        check_replacing(Misnumbering)


@pytest.mark.timeout(120)
def test_the_replacement_cases_fail_a_replacement_whose_answers_are_not_stamped() -> None:
    with pytest.raises(ConformanceError, match=r"incarnation 0 of worker 0 was sent"):
        check_replacing(Unstamped)


@pytest.mark.timeout(300)
@MANY_WORKERS
# The kit over mp alone is above, and the pinned executor over mp in tests/test_pinned.py; the
# exhaustive tier runs the kit over the pair too.
@pytest.mark.parametrize(
    "inner", ["inline", pytest.param("mp", marks=pytest.mark.exhaustive), "thread"]
)
def test_the_pinned_executor_passes_the_kit_over_each_inner_executor(
    inner: str, pinning_clones: None
) -> None:
    # The Hypothesis machine with 3 drawn runs, not the kit's 10: it draws the inner
    # executor's configurations, which the test above runs it for with the full 10.
    machine = Settings(max_examples=3, stateful_step_count=6, deadline=None, derandomize=True)
    report = check_executor(pinned(inner, pin=torch_pin_memory), settings=machine)
    # Over an executor with workers it passes the replacement cases on (and thread's are the
    # default tier's proof that it does; mp's are the exhaustive tier's).
    replaced = () if inner == "inline" else tuple(case.name for case in replace_cases())
    assert report.replace_cases == replaced


@pytest.mark.timeout(120)
def test_the_kit_takes_a_bare_executor_factory() -> None:
    report = check_executor(InlineExecutor, in_process=True)
    assert report.cases == tuple(case.name for case in matrix(in_process=True))


@pytest.mark.timeout(120)
def test_the_kit_names_the_configuration_a_broken_executor_fails() -> None:
    with pytest.raises(ConformanceError, match="'sequential, batch 3', epoch 1"):
        check_executor(Blanking, in_process=True)


@pytest.mark.timeout(120)
def test_a_case_compares_every_epoch_with_torchs() -> None:
    case = Case("three epochs", lambda: list(range(6)), lambda: {"batch_size": 2}, epochs=3)
    run_case("inline", case)  # the real executor agrees
    with pytest.raises(ConformanceError, match="'three epochs', epoch 1"):
        run_case(Blanking, case)


def test_the_matrix_uses_workers_only_for_executors_with_workers() -> None:
    in_process = matrix(in_process=True)
    with_workers = matrix(in_process=False, workers=3)
    assert all(case.arguments().get("num_workers", 0) == 0 for case in in_process)
    assert {case.arguments().get("num_workers") for case in with_workers} == {1, 3}
    assert any(not case.in_order for case in with_workers)
    assert any(case.arguments().get("persistent_workers") for case in with_workers)


@pytest.mark.parametrize(
    ("executor", "expected"),
    [
        ("inline", True),
        ("mp", False),
        ("thread", False),
        ("pinned", False),
        (pinned("inline"), True),
        (pinned("mp"), False),
        (InlineExecutor, False),
    ],
)
def test_the_kit_knows_which_executors_load_in_process(executor: object, expected: bool) -> None:
    assert loads_in_process(executor) is expected  # type: ignore[arg-type]
