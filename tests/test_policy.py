"""The core's policies sit behind one seam: `step` reads the `Policy` in force, and
`policy_replaced` swaps fields of it for the length of a block, as the mutants do."""

from __future__ import annotations

import attrs
import pytest
from _drive import config, start

from statecore import (
    DEFAULT_POLICY,
    DrawIndex,
    Policy,
    ResetRequested,
    WorkerStatus,
    initial_state,
    policy_replaced,
    step,
)


def _never(*arguments: object) -> None:
    return None


def test_a_replaced_policy_decides_inside_the_block_and_the_default_after() -> None:
    with policy_replaced(pick_worker=_never) as policy:
        assert policy.pick_worker is _never
        assert step(initial_state(config()), ResetRequested()).commands == ()
    assert start(config())[1] == [DrawIndex()]


def test_the_policy_in_force_comes_back_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), policy_replaced(pick_worker=_never):
        raise RuntimeError("a failing model run")
    assert start(config())[1] == [DrawIndex()]


def test_the_default_policy_holds_every_decision_as_a_function_of_values() -> None:
    fields = attrs.fields(Policy)
    assert {field.name for field in fields} >= {"pick_worker", "deliverable", "epoch_over"}
    assert all(callable(getattr(DEFAULT_POLICY, field.name)) for field in fields)
    assert DEFAULT_POLICY.resume_complete((WorkerStatus.ACTIVE, WorkerStatus.RESUMING)) is False
    assert DEFAULT_POLICY.resume_complete((WorkerStatus.ACTIVE, WorkerStatus.ACTIVE)) is True


def test_an_unknown_policy_name_is_refused() -> None:
    with pytest.raises(TypeError), policy_replaced(pick_a_worker=_never):
        pass
