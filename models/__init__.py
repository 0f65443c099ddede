"""Executable specifications of the scheduler core.

- `reference`: what an epoch must hand over, computed the obvious way.
- `world`: a simulated sampler, workers and consumer that drive the core and check it.
- `machines`: Hypothesis state machines over that world, reusable with any step function.
- `explorer`: breadth-first exploration of every reachable world of small configurations.
- `mutants`: deliberate bugs, to show that the checks above can fail.
- `conformance`: a Hypothesis machine that drives a real executor through `DataLoader` and
  compares it with torch's, for any executor name or factory.
- `kit`: the executor conformance kit, `check_executor`: a torch comparison matrix and the
  machine above, in one call.
- `datasets`: the datasets of those two, in a module that imports only torch (a spawned worker
  or a Ray actor imports it to unpickle them).

The programs that use them (the `python -m statecore` commands, the benchmarks) live in
`statecore.tools`; nothing here imports them.

Import the submodules directly (`from statecore.models.explorer import explore`); this package
imports nothing heavy on its own.
"""
