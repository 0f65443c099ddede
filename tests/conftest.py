"""Shared test setup: the Hypothesis profile (ci by default, see statecore.models.profiles), and
the fixtures more than one test module uses."""

from collections.abc import Iterator

import pytest
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
