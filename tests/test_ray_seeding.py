"""Seeding per batch under Ray's actors (`executor="ray"`), against a real local Ray instance:
the batches are those of loading in the calling thread, as with worker processes
(tests/test_seeding.py). Kept small: one loader of two actors."""

from __future__ import annotations

from typing import Any

import pytest
from _ray_local import live_actors, local_cluster, settles
from test_seeding import _batches

ray = pytest.importorskip("ray")

cluster = pytest.fixture(name="cluster")(local_cluster)


@pytest.mark.timeout(180)
def test_ray_actors_give_the_batches_of_loading_in_the_calling_thread(cluster: Any) -> None:
    assert _batches(2, "ray") == _batches(0)
    assert settles(lambda: not live_actors())
