"""The programs: the `python -m statecore` commands and what only they use.

- `cli`: the command line, `python -m statecore check | diagram | demo | bench`.
- `demo`: `python -m statecore demo`, statecore's DataLoader next to torch's.
- `loader_bench`, `workloads`: `python -m statecore bench`, the two loaders side by side on
  each workload.
- `step_bench`, `torch_bookkeeping`: `check --bench`, the cost of one `step` against torch's
  bookkeeping written with mutable counters, and how it grows with the number of workers.
- `diagram`: the state diagram of docs/state-machine.md, drawn from the transition table.

The programs use the core, the executors and the models; nothing there imports them
(tests/test_import_graph.py checks it). Import the submodules directly
(`from statecore.tools.cli import main`); this package imports nothing on its own.
"""
