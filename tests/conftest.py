"""Shared test setup: the Hypothesis profile (ci by default, see statecore.models.profiles), and
the fixtures more than one test module uses."""

import sys
from collections.abc import Iterator

import pytest
from _processes import release_kept_buffers
from _wire import pair

from statecore.models.profiles import load_profile

__all__ = ["pair"]

load_profile()


@pytest.fixture(autouse=True, scope="session")
def flight_files_in_a_folder_of_the_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """The flight recorder's files (written by every test that makes a loader time out) go to
    a folder of this run, not the machine's temp folder (see docs/flight-recorder.md)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STATECORE_FLIGHT_DIR", str(tmp_path_factory.mktemp("flight")))
        yield


@pytest.fixture(autouse=True)
def no_buffers_kept_from_an_earlier_test() -> None:
    """Each test's workers start without the buffers an earlier test's workers left for the next
    ones (the mp executor keeps them: docs/architecture.md, "How tensors travel")."""
    release_kept_buffers()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Once a test's fixtures are torn down: the local Ray instance of the Ray tests goes on to
    the next test only if it asks for it too (tests/_ray_local.py). Only where a Ray test ran:
    importing Ray takes seconds."""
    yield
    ray_local = sys.modules.get("_ray_local")
    if ray_local is not None:
        ray_local.shut_down_unless_wanted(nextitem)
