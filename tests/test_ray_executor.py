"""The Ray executor (`executor="ray"`) against a real local Ray instance with 2 CPUs.

One Ray instance serves this module and the Ray tests run next to it (`cluster`,
tests/_ray_local.py), started by the first test that needs it and shut down before the first
test that does not. The shutdown is for the rest of the suite: Ray's driver
runs gRPC and I/O threads in this process, and the mp executor's tests fork worker processes
from it afterwards, in the same pytest process. A child forked while such a thread holds a
lock inherits the lock held; after `ray.shutdown()` the connection is closed and the local
instance's processes are gone, so later forks copy no live Ray state. Checked by running
`pytest tests/test_ray_executor.py tests/test_mp_*.py tests/test_loader_api.py -p no:randomly`
(Ray first, then every fork-based test): all pass.

The datasets are defined in tests/_ray_datasets.py, a light module: the actors' processes
import it to unpickle them (the fixture puts the tests' folder on their PYTHONPATH). Items
carry the pid of the actor that made them, which is how a test learns whom to kill.
"""

from __future__ import annotations

import gc
import os
import signal
from typing import Any

import pytest
import torch
import torch.utils.data
from _checkpoints import roundtrip, run_to_end, take
from _datasets import Numbers, ShardedRange, StatefulDataset, StatefulIterator
from _ray_datasets import Drawn, Pids, Sharded, StuckAt, mark_initialised, skew_the_clock
from _ray_local import live_actors, local_cluster, owned_references, settles
from hypothesis import settings as Settings
from hypothesis.stateful import run_state_machine_as_test

import statecore
from statecore import LoaderTimeoutError, WorkerDiedError
from statecore.executors import RayOptions
from statecore.models.conformance import executor_machine
from statecore.models.kit import check_executor, matrix, replace_cases, run_case

ray = pytest.importorskip("ray")

cluster = pytest.fixture(name="cluster")(local_cluster)


def torch_batches(dataset: Any, **options: Any) -> list[Any]:
    return list(torch.utils.data.DataLoader(dataset, **options))


def same(left: Any, right: Any) -> bool:
    if isinstance(left, torch.Tensor):
        return isinstance(right, torch.Tensor) and torch.equal(left, right)
    if isinstance(left, dict):
        return left.keys() == right.keys() and all(same(left[k], right[k]) for k in left)
    if isinstance(left, list | tuple):
        return len(left) == len(right) and all(map(same, left, right))
    return bool(left == right)


@pytest.mark.timeout(180)
def test_map_style_batches_equal_torchs_shuffled_by_a_generator(cluster: Any) -> None:
    options: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    dataset = Drawn()
    expected = torch_batches(
        dataset,
        generator=torch.Generator().manual_seed(7),
        worker_init_fn=mark_initialised,
        **options,
    )
    loader = statecore.DataLoader(
        dataset,
        executor="ray",
        generator=torch.Generator().manual_seed(7),
        worker_init_fn=mark_initialised,
        **options,
    )
    got = list(loader)
    # Seeds, worker ids and what worker_init_fn set, as torch's worker processes have them.
    assert same(got, expected)
    assert {int(w) for batch in got for w in batch["worker"]} == {0, 1}
    assert settles(lambda: not live_actors())


@pytest.mark.timeout(180)
def test_an_iterable_dataset_shards_itself_as_with_torchs_workers(cluster: Any) -> None:
    options: dict[str, Any] = {"batch_size": 3, "num_workers": 2}
    expected = torch_batches(Sharded(), generator=torch.Generator().manual_seed(3), **options)
    got = list(
        statecore.DataLoader(
            Sharded(), executor="ray", generator=torch.Generator().manual_seed(3), **options
        )
    )
    assert same(got, expected)


@pytest.mark.timeout(180)
def test_persistent_workers_keep_their_actors_and_their_order_across_epochs(
    cluster: Any,
) -> None:
    loader = statecore.DataLoader(
        Pids(12),
        batch_size=2,
        num_workers=2,
        executor="ray",
        persistent_workers=True,
        in_order=False,
    )
    first = list(loader)
    second = list(loader)
    for epoch in (first, second):
        assert sorted(int(i) for batch in epoch for i in batch[0]) == list(range(12))
    pids = {int(p) for batch in first for p in batch[1]}
    assert pids == {int(p) for batch in second for p in batch[1]}  # the same two actors
    assert len(pids) == 2 and os.getpid() not in pids
    assert len(live_actors()) == 2
    del loader
    gc.collect()
    assert settles(lambda: not live_actors())


@pytest.mark.timeout(240)
def test_a_map_style_checkpoint_taken_under_ray_resumes_exactly_under_ray(cluster: Any) -> None:
    options: dict[str, Any] = {"batch_size": 3, "num_workers": 2, "executor": "ray"}
    original = statecore.DataLoader(
        Numbers(30), shuffle=True, generator=torch.Generator().manual_seed(5), **options
    )
    iterator = iter(original)
    take(iterator, 4)
    state = roundtrip(original.state_dict())
    rest = run_to_end(iterator)
    resumed = statecore.DataLoader(
        Numbers(30), shuffle=True, generator=torch.Generator().manual_seed(99), **options
    )
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == rest and rest


# A fast-forward (ShardedRange) and a dataset's state (StatefulIterator) are the two things a
# mark carries; where a stateful dataset keeps its state is the worker's, not Ray's, and the
# exhaustive tier runs it too.
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "dataset",
    [ShardedRange, StatefulIterator, pytest.param(StatefulDataset, marks=pytest.mark.exhaustive)],
)
def test_an_iterable_checkpoint_taken_under_ray_resumes_each_workers_part_exactly(
    cluster: Any, dataset: type
) -> None:
    # Each actor's dataset state (or a fast-forward, for ShardedRange) rides on its batches'
    # marks across the object store, as on the mp executor's pipes.
    options: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "executor": "ray"}
    original = statecore.DataLoader(dataset(23), **options)
    iterator = iter(original)
    take(iterator, 5)
    state = roundtrip(original.state_dict())
    rest = run_to_end(iterator)
    resumed = statecore.DataLoader(dataset(23), **options)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == rest and rest


# Every loader of the kit starts fresh actors, each importing torch: about 4 s a case on a
# 2-core machine. The default tier runs the cases where Ray's own paths differ and no test above
# compares them with torch (epochs and their seeds, an error carried back, persistent actors
# through abandoned epochs) and the Hypothesis machine. Map-style batches, iterable shards and
# answers out of order are compared above; the rest of the matrix is the loader's, which the
# default tier compares for the other executors (tests/test_conformance_kit.py), and the
# exhaustive tier runs the rest of it for Ray. The kit's replacement cases (about ten actors more)
# are the exhaustive tier's too: the default tier replaces a killed actor once
# (tests/test_ray_restarts.py) and runs the replacement cases on the thread and mp executors.
RAY_CASES = (
    "shuffled by a generator",
    "dataset error in its turn",
    "persistent workers, abandoned epochs",
)


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_the_ray_executor_passes_the_conformance_kit_on_rays_own_paths(cluster: Any) -> None:
    cases = [case for case in matrix(in_process=False) if case.name in RAY_CASES]
    assert len(cases) == len(RAY_CASES)
    for case in cases:
        run_case("ray", case)  # raises ConformanceError on any difference from torch
    # The Hypothesis machine with fewer drawn runs than the kit's default 10.
    machine = Settings(max_examples=3, stateful_step_count=6, deadline=None, derandomize=True)
    run_state_machine_as_test(
        executor_machine("ray", in_process=False, max_workers=2), settings=machine
    )
    assert settles(lambda: not live_actors())


@pytest.mark.exhaustive
@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_the_ray_executor_passes_the_rest_of_the_conformance_kit(cluster: Any) -> None:
    # Through `check_executor("ray")` itself (docs/distributed.md), on the cases the test above
    # leaves out: with it, the whole matrix.
    machine = Settings(max_examples=3, stateful_step_count=6, deadline=None, derandomize=True)
    rest = [case for case in matrix(in_process=False) if case.name not in RAY_CASES]
    report = check_executor("ray", settings=machine, cases=rest)
    assert "'ray'" in report.describe()
    assert set(report.cases) | set(RAY_CASES) == {case.name for case in matrix(False)}
    # Ray declares that it replaces workers: the kit ran its replacement cases on actors.
    assert report.replace_cases == tuple(case.name for case in replace_cases())
    assert settles(lambda: not live_actors())


@pytest.mark.timeout(180)
def test_an_actor_killed_mid_epoch_fails_the_loader_naming_worker_pid_and_rays_text(
    cluster: Any,
) -> None:
    before = owned_references()
    loader = statecore.DataLoader(Pids(200), batch_size=2, num_workers=2, executor="ray")
    batches = iter(loader)
    first = next(batches)  # task 0 goes to worker 0
    victim = int(first[1][0])
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(WorkerDiedError) as raised:
        for _ in batches:
            pass
    error = raised.value
    assert error.worker == 0
    assert error.pid == victim
    message = str(error)
    assert f"pid {victim}" in message
    assert "statecore worker 0" in message
    assert "Ray reported" in message and "actor" in message.lower()
    assert str(victim) in message.split("Ray reported", 1)[1]  # Ray's own text names it
    del batches, first, loader
    gc.collect()
    assert settles(lambda: not live_actors())
    assert owned_references() <= before


@pytest.mark.timeout(180)
def test_a_worker_that_never_answers_times_out_and_its_actor_is_killed(cluster: Any) -> None:
    loader = statecore.DataLoader(
        StuckAt(0), batch_size=None, num_workers=2, executor="ray", timeout=5
    )
    with pytest.raises(LoaderTimeoutError):
        for _ in loader:
            pass
    # The actor stuck in its item is killed with the loader, not left to finish it.
    assert settles(lambda: not live_actors())


@pytest.mark.timeout(180)
def test_nothing_is_left_behind_after_exhaustion_abandonment_or_collection(cluster: Any) -> None:
    before = owned_references()
    loader = statecore.DataLoader(Pids(40), batch_size=4, num_workers=2, executor="ray")

    exhausted = list(loader)
    assert len(exhausted) == 10
    assert settles(lambda: not live_actors())

    for _ in loader:
        break  # the iterator goes with the loop
    gc.collect()
    assert settles(lambda: not live_actors())

    abandoned = iter(loader)
    next(abandoned)
    assert len(live_actors()) == 2
    del abandoned
    gc.collect()
    assert settles(lambda: not live_actors())

    del exhausted, loader
    gc.collect()
    # Every batch's object and every call's result was let go of with the loader.
    assert owned_references() <= before


@pytest.mark.timeout(180)
def test_the_factory_passes_actor_options_to_ray(cluster: Any) -> None:
    # Every node has the custom resource "node:<its address>": asking for a sliver of it
    # places the actors on that node, as a cluster's own custom resources would.
    here = {f"node:{ray.util.get_node_ip_address()}": 0.01}
    factory = statecore.executors.ray(num_cpus=1, resources=here, scheduling_strategy="SPREAD")
    assert factory.options == RayOptions(num_cpus=1)  # resources and strategy compare as equal
    assert factory.options.actor_options() == {
        "max_restarts": 0,
        "max_task_retries": 0,
        "num_cpus": 1,
        "resources": here,
        "scheduling_strategy": "SPREAD",
    }
    # Each of two actors reserves one of the instance's two CPUs while it lives.
    loader = statecore.DataLoader(Pids(8), batch_size=2, num_workers=2, executor=factory)
    batches = iter(loader)
    next(batches)
    assert ray.available_resources().get("CPU", 0.0) == 0.0
    del batches
    gc.collect()
    assert settles(lambda: ray.available_resources().get("CPU", 0.0) == 2.0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("elsewhere", [False, True], ids=["same-node", "other-node"])
def test_a_traced_actors_times_are_on_the_training_processs_clock(
    cluster: Any, monkeypatch: pytest.MonkeyPatch, elsewhere: bool
) -> None:
    options: dict[str, Any] = {}
    if elsewhere:
        # One machine stands in for two: the actors' clock runs ahead, and this process is
        # told it is on another node than they are.
        import statecore.executors._ray as ray_executor

        monkeypatch.setattr(ray_executor, "_this_node", lambda library: "the-training-node")
        options["worker_init_fn"] = skew_the_clock
    loader = statecore.DataLoader(
        Pids(16), batch_size=2, num_workers=2, executor="ray", trace=True, **options
    )
    assert len(list(loader)) == 8
    trace = loader.trace_record()
    for batch in trace.batches:
        assert batch.started is not None and batch.finished is not None
        assert batch.arrived is not None
        # No task starts before it was sent or ends after its answer arrived.
        assert batch.sent <= batch.started <= batch.finished <= batch.arrived
    ready = [mark for mark in trace.marks if mark.kind == "worker ready"]
    assert len(ready) == 2 and all(mark.time < trace.end for mark in ready)
