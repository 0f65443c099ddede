"""`num_workers="auto"`: the shell around the tuning policy (`statecore._tuning`).

The loader keeps one `AutoTuner`. Between the consumer's `next()` calls it measures what the
policy reads (how long the training loop waited inside `next()`, the gaps between requests,
which workers had a task in hand), and every `WINDOW` batches hands the policy a `LoadWindow`
and carries its decision out through the driver (`Driver.add`, `Driver.retire`): the changes go
through the core's events, so every guarantee of the scheduler holds through them.

Budgets: the slots (`slots_for`: eight per core the process may use, so that a loader whose
samples wait on I/O may run more workers than cores), the CPU budget (the cores: once this
process and its worker processes ask for nearly all of them, busy on them or waiting in the run
queue for them, an add is only tried and kept if it pays, and past them an added worker must
pay more to be kept), and memory (`MEMORY_SHARE` of the memory available as
the loader first starts, over the largest worker's measured footprint; worker processes only,
since threads share one process; the footprint's page-table walk only where the workers'
resident sizes, an upper bound read cheaply, say the budget may not hold every slot).

What it learned carries over: with persistent workers the retired slots stay retired into the
next epoch; without, the next epoch's iterator starts with the count the last one ended with.

`prefetch_factor="auto"` (with a worker count or with "auto") tunes the prefetch bound too,
through the policy `decide_prefetch` and the core's `PrefetchChangeRequested` (`Driver.prefetch`):
a window that changes the bound changes nothing else, so each change is judged on its own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch.utils.data

from statecore import (
    LoadWindow,
    Pending,
    PrefetchBudget,
    PrefetchDecision,
    PrefetchTuner,
    ProtocolError,
    State,
    Tuner,
    Tuning,
    TuningDecision,
    TuningMove,
    WorkerBudget,
    WorkerStatus,
    decide_prefetch,
    decide_workers,
)

__all__ = [
    "AUTO",
    "AutoTuner",
    "AutoPrefetch",
    "AutoTuning",
    "AutoWorkers",
    "TuningRecord",
    "auto_num_workers",
    "auto_prefetch_factor",
    "cpu_budget",
    "slots_for",
]

AUTO = "auto"
START_WITH = 2
"""Workers an auto loader starts with (fewer where it has fewer slots): the first batch comes as
quickly as with two."""
WINDOW = 16
"""Batches a window of figures covers at least: the policy is asked once per window."""
FIRST_WINDOW = 8
"""Batches the tuner's first window covers at least: every batch of it is made by the
`START_WITH` workers a loader starts with, so a loop that starves on them starves for each
batch the window waits for."""
WINDOW_SECONDS = 0.5
"""Seconds a window covers at least: fast batches are counted over a longer window, whose
figures wobble less."""
SLOTS_PER_CPU = 8
COOLDOWN = Tuning().cooldown
STARVED = Tuning().starved_above
"""A window after one in which the loop waited over this share covers `WINDOW` batches however
quickly they came."""
"""Batches after a change before a window begins: the policy holds on a window begun sooner, so
measuring one would cost a whole window per change."""
MEMORY_SHARE = 0.5
"""The share of the memory available as the loader starts that its workers may take."""
BUSY_EVERY = 4
"""Which workers have a task in hand is sampled every this many batches (a scan of the
window), not on every batch."""
MEMORY_SECONDS = 5.0
"""Seconds between two measures of the workers' footprint, whatever the windows' length: a
worker's proportional set size is read from /proc/PID/smaps_rollup, which walks its page tables
(about 4 ms a worker on this project's machine, 65 ms for 16), too much for every window of a
starving loop (16 batches: over 0.5 ms a batch at 900 batches/s)."""
START_PREFETCH = 2
"""The bound `prefetch_factor="auto"` starts with: torch's default."""
MOST_PREFETCH = 8
"""The deepest bound it sets: each task a worker holds keeps a batch in memory (and one of its
shared-memory buffers, of which a worker's pool holds 16)."""

_ACTIVE = WorkerStatus.ACTIVE
_STOPPED = WorkerStatus.STOPPED
_STARTING = WorkerStatus.STARTING
_RETIRING = WorkerStatus.RETIRING


class _RemembersAuto(int):
    """An int that remembers it was given as "auto": it prints and compares as the int, and
    a copy or a pickle of it is one again."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({int(self)})"

    def __str__(self) -> str:
        return int.__repr__(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (int(self),))


class AutoWorkers(_RemembersAuto):
    """`num_workers="auto"` as the loader keeps it: an int, the worker slots (the most workers
    it may run), which is what torch's own code and `get_worker_info().num_workers` see, that
    remembers it was "auto". A loader rebuilt from its attributes (as frameworks do) is "auto"
    again."""


class AutoPrefetch(_RemembersAuto):
    """`prefetch_factor="auto"` as the loader keeps it: an int, the bound it starts with
    (torch's code reads it as one), that remembers it was "auto"."""


def auto_prefetch_factor(prefetch_factor: Any, num_workers: Any) -> Any:
    """`prefetch_factor` as the loader keeps it: "auto" becomes `AutoPrefetch`; anything else
    is left to torch's validation, except another string, refused in words."""
    if not isinstance(prefetch_factor, str):
        return prefetch_factor
    if prefetch_factor != AUTO:
        raise ValueError(
            f"prefetch_factor must be an integer (batches loaded in advance by each worker; "
            f'torch\'s default is 2), or "auto" to let the loader tune it as it runs; got '
            f"prefetch_factor={prefetch_factor!r}"
        )
    if num_workers == 0:
        raise ValueError(
            'prefetch_factor="auto" tunes how many batches each worker loads in advance, and '
            "with num_workers=0 the batches are loaded in the calling thread, on request: "
            'nothing is loaded in advance. Set num_workers >= 1 (or "auto"), or leave '
            "prefetch_factor unset"
        )
    return AutoPrefetch(START_PREFETCH)


def cpu_budget() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS and Windows have no affinity
        return os.cpu_count() or 1


def slots_for(cpus: int) -> int:
    """The worker slots of an auto loader on `cpus` cores: eight per core, at least sixteen
    (an I/O-bound load is served best by many more workers than cores; the memory budget, a
    worker's measured footprint, still bounds them)."""
    return max(SLOTS_PER_CPU * cpus, 16)


def auto_num_workers(num_workers: Any, dataset: Any) -> Any:
    """`num_workers` as the loader keeps it: "auto" becomes `AutoWorkers`; anything else is
    left to torch's validation, except a string, refused as torch would refuse it, in words."""
    if isinstance(num_workers, str):
        if num_workers != AUTO:
            raise ValueError(
                f'num_workers option should be non-negative, or "auto" to let the loader choose '
                f"and change the count as it runs; got num_workers={num_workers!r}"
            )
        num_workers = AutoWorkers(slots_for(cpu_budget()))
    if isinstance(num_workers, AutoWorkers) and isinstance(
        dataset, torch.utils.data.IterableDataset
    ):
        raise ValueError(
            'num_workers="auto" needs a map-style dataset: each worker of an iterable dataset '
            f"({type(dataset).__name__}) yields its own part of the data "
            "(get_worker_info().id of num_workers), so retiring a worker mid-epoch would lose "
            "the rest of its part and adding one would need a part nobody has. Pick a count: "
            "num_workers=N (python -m statecore profile suggests one)"
        )
    return num_workers


@attrs.frozen
class TuningRecord:
    """One change the tuner made."""

    batch: int
    """Batches handed over in the loader's life when it was decided."""
    epoch: int
    move: TuningMove
    workers: int
    """Workers running once it took effect."""
    why: str
    by: int = 1
    """Workers it added or retired."""
    prefetch: int | None = None
    """The prefetch bound once it took effect, for a change of the bound (else None)."""

    def describe(self) -> str:
        if self.prefetch is not None:
            verb = "raised" if self.move is TuningMove.RAISE_PREFETCH else "lowered"
            return (
                f"batch {self.batch} (epoch {self.epoch}): {verb} prefetch_factor to "
                f"{self.prefetch}: {self.why}"
            )
        verb = "added" if self.move is TuningMove.ADD else "retired"
        verb += " a worker" if self.by == 1 else f" {self.by} workers"
        return f"batch {self.batch} (epoch {self.epoch}): {verb}, {self.workers} now: {self.why}"


@attrs.frozen
class AutoTuning:
    """What `num_workers="auto"` did: `DataLoader.stats().tuning`."""

    slots: int
    cpus: int
    memory: int | None
    """The most workers the memory budget held when last measured (by their resident sizes
    where those said it held every slot: then at least the slots, and maybe more); None if not
    measured."""
    workers: int
    """Workers running now: the count to pin (`num_workers=...`) once it has settled."""
    settled: bool
    decisions: tuple[TuningRecord, ...]
    latest: str
    """The policy's latest reason, change or not."""
    seeding: str = "per-batch"
    """The loader's seeding: what a pinned loader needs too for the same random draws."""
    prefetch: int | None = None
    """The prefetch bound now, where `prefetch_factor="auto"` tunes it (else None)."""
    tunes_workers: bool = True
    """Whether `num_workers="auto"` tunes the count (else only the prefetch bound is tuned)."""

    def describe(self) -> list[str]:
        """The tuning, in words, for the verdict."""
        state = "settled on" if self.settled else "running"
        memory = "" if self.memory is None else f", memory for {self.memory}"
        changes = f"after {len(self.decisions)} change(s)"
        lines = []
        if self.tunes_workers:
            lines.append(
                f'num_workers="auto": {state} {self.workers} worker(s) {changes} (budget: '
                f"{self.slots} slots, {self.cpus} cores{memory}); latest: {self.latest}."
            )
        if self.prefetch is not None:
            lines.append(
                f'prefetch_factor="auto": {self.prefetch} batch(es) in advance per worker'
                + ("." if self.tunes_workers else f" {changes}; latest: {self.latest}.")
            )
        lines += [f"- {record.describe()}" for record in self.decisions]
        if self.settled:
            # Pinned, an auto loader's count seeds per worker unless told: say so, or the
            # pinned run's random augmentations would differ from the tuned one's.
            pins = [f"num_workers={self.workers}"] if self.tunes_workers else []
            if self.prefetch is not None:
                pins.append(f"prefetch_factor={self.prefetch}")
            if self.tunes_workers and self.seeding == "per-batch":
                pins.append(f'seeding="{self.seeding}"')
            lines.append(f"To pin it: {', '.join(pins)}.")
        return lines


class AutoTuner:
    """The loader's tuner: measures between `next()` calls, asks the policy, carries out.

    `decide` is the policy (tests pass their own, to drive it with figures of their choosing);
    `clock` what the waits are timed with; a window covers at least `window` batches (the
    first, `first_window`) and `window_seconds` seconds.
    """

    def __init__(
        self,
        slots: int,
        cpus: int | None = None,
        *,
        decide: Callable[
            [Tuner, LoadWindow, WorkerBudget], tuple[Tuner, TuningDecision]
        ] = decide_workers,
        clock: Callable[[], float] = time.perf_counter,
        available_memory: int | None = None,
        window: int = WINDOW,
        first_window: int = FIRST_WINDOW,
        window_seconds: float = WINDOW_SECONDS,
        tunes_workers: bool = True,
        prefetch: int | None = None,
        decide_prefetch: Callable[
            [PrefetchTuner, LoadWindow, PrefetchBudget], tuple[PrefetchTuner, PrefetchDecision]
        ] = decide_prefetch,
    ) -> None:
        self.slots = slots
        self.tunes_workers = tunes_workers
        """`num_workers="auto"`: the count is tuned (else every slot runs)."""
        self.prefetcher = None if prefetch is None else PrefetchTuner(prefetch)
        """`prefetch_factor="auto"`: the prefetch policy's memory, starting from `prefetch`."""
        self.decide_prefetch = decide_prefetch
        self.window = window
        self.first_window = min(first_window, window)
        self.window_seconds = window_seconds
        self.cpus = cpu_budget() if cpus is None else cpus
        self.decide = decide
        self.clock = clock
        self.tuner = Tuner()
        self.workers = min(START_WITH, slots) if tunes_workers else slots
        """Workers running (or to start with, in the next iterator)."""
        self.records: list[TuningRecord] = []
        self.latest = "measuring"
        self.batch = 0
        memory = _available_memory() if available_memory is None else available_memory
        self.memory_budget = None if memory is None else memory * MEMORY_SHARE
        self.memory: int | None = None
        self.measured_memory_at: float | None = None
        self.windows = 0
        self.changed_at = -COOLDOWN
        self.loaded_ahead = 0
        """The batch (counted over the loader's life) by which the batches in flight as the
        epoch's first was handed over are handed over too (see `handed`)."""
        self.starving = False
        """The loop waited over `STARVED` of the last window."""
        """The batch of the last change."""
        self.seeding = "per-batch"
        """The loader's seeding, for the count to pin (see `AutoTuning.seeding`)."""
        self._restart()

    def _restart(self) -> None:
        """Begin a new window with the next request."""
        self.began: float | None = None
        self.cpu_began: dict[int, tuple[float, float | None]] | None = None
        self.last: float | None = None
        self.count = 0
        self.waited = 0.0
        self.longest_gap = 0.0
        self.busy = 0.0
        self.samples = 0
        self.ahead = 0
        """Of the window's batches, those loaded during the epoch's start-up (see `handed`)."""
        self.ahead_seconds = 0.0
        self.ahead_waited = 0.0

    def begin_epoch(self) -> None:
        """An epoch begins: its first batch (the workers' start-up) is not measured."""
        self._restart()

    @property
    def prefetch(self) -> int | None:
        """The prefetch bound it tuned (the next iterator's too); None where not tuned."""
        return None if self.prefetcher is None else self.prefetcher.prefetch

    def report(self) -> AutoTuning:
        settled = self.tuner.settled or self.tuner.locked or not self.tunes_workers
        return AutoTuning(
            slots=self.slots,
            cpus=self.cpus,
            memory=self.memory,
            workers=self.workers,
            settled=settled,
            decisions=tuple(self.records),
            latest=self.latest,
            seeding=self.seeding,
            prefetch=self.prefetch,
            tunes_workers=self.tunes_workers,
        )

    # --- between the consumer's calls ----------------------------------------------------------

    def asking(self) -> float:
        """The consumer asks for a batch: the moment it did."""
        return self.clock()

    def handed(self, driver: Any, asked: float, executor: Any) -> None:
        """A batch was handed over, asked for at `asked`."""
        now = self.clock()
        self.batch += 1
        state: State = driver.state
        workers = state.life.workers
        if self.last is None:
            self.loaded_ahead = self.batch + len(state.window)
        if (
            self.last is None
            or _STARTING in workers
            or _RETIRING in workers
            or self.batch <= self.changed_at + COOLDOWN
        ):
            # The epoch's first batch (start-up), a change not in effect yet, or its cool-down
            # (a window begun in it would only be held): the window begins after them.
            self._restart()
            self.last = now
            return
        if self.began is None:
            self.began = asked
            self.cpu_began = _cpu_seconds(executor)
        else:
            self.longest_gap = max(self.longest_gap, asked - self.last)
        self.waited += now - asked
        self.last = now
        ahead = self.batch <= self.loaded_ahead
        if (
            self.batch == self.loaded_ahead
            and not self.starving
            and self.waited <= STARVED * (now - self.began)
        ):
            # The batches the workers loaded while the epoch's first waited for their start-up
            # come at once: counted, they made 2 workers of `mixed` under a busy training step
            # look a few percent faster than they are, over the half second that judges the
            # next add. A loop that does not starve is measured from here.
            self._restart()
            self.last = now
            return
        count = self.count = self.count + 1
        if ahead:
            # A starving loop is decided on its waiting from the epoch's second batch (a jump
            # not to be delayed; measured after these batches, cpu-spin's first window was 14 ms
            # and its CPU figures said its workers slept: docs/tuning-history.md, stop 46), but
            # these batches are left out of the rate its jump is judged against.
            self.ahead = count
            self.ahead_seconds = now - self.began
            self.ahead_waited = self.waited
        if count % BUSY_EVERY == 0:
            running = workers.count(_ACTIVE)
            if running:
                holding = {slot.worker for slot in state.window if type(slot) is Pending}
                self.busy += len(holding) / running
                self.samples += 1
        # A starving loop is measured over `window` batches alone (the first window over
        # `first_window`): its waiting is not noise, and each half second spent measuring it is
        # spent starving. Starving in the last window, or in this one already: the first window
        # of a loader that starts too small is one.
        if count >= (self.window if self.windows else self.first_window):
            elapsed = now - self.began
            starving = self.starving or self.waited > STARVED * elapsed
            # A judgement a short window could not make is made over `window_seconds`.
            quick = starving and self._may_change() and not self.tuner.long_window
            if elapsed >= self.window_seconds or quick:
                self._decide(driver, state, workers.count(_ACTIVE), now, executor)

    def _workers_memory_holds(self, executor: Any) -> int | None:
        """The most workers the memory budget holds, over the largest worker's footprint.

        A worker's proportional set size is read by walking its page tables (65 ms of the main
        process for 11 workers of `mixed` on this project's machine, stalling the training
        loop's next batch; 1 to 2% of a 2400-batch run), so it is read where it could matter
        alone: after the first window, and where the workers' resident sizes, read in
        microseconds and never below their proportional sizes, no longer say the budget holds
        every slot. Where they say so, that count (at least the slots) is the answer."""
        assert self.memory_budget is not None
        if self.memory is not None:
            resident = _largest_resident(executor)
            if resident:
                held = int(self.memory_budget // resident)
                if held >= self.slots:
                    return held
        footprint = _largest_footprint(executor)
        if footprint:
            return max(1, int(self.memory_budget // footprint))
        return self.memory

    def _may_change(self) -> bool:
        """Whether the policies may still change something on a starving loop's window: a
        settled tuner (a loop waiting on the best count its budget allows, say) is measured over
        half-second windows again, as each window reads /proc for every worker, and it wakes
        only after two windows of waiting anyway."""
        if self.tunes_workers and not (self.tuner.settled or self.tuner.locked):
            return True
        tuner = self.prefetcher
        deepest = MOST_PREFETCH if tuner is None or tuner.ceiling is None else tuner.ceiling
        return tuner is not None and tuner.prefetch < deepest

    def _decide(self, driver: Any, state: State, running: int, now: float, executor: Any) -> None:
        assert self.began is not None
        seconds = now - self.began
        cpu, queued = _cores_used(self.cpu_began, _cpu_seconds(executor), seconds)
        window = LoadWindow(
            batch=self.batch,
            batches=self.count,
            seconds=seconds,
            waited=self.waited,
            longest_gap=self.longest_gap,
            busy=self.busy / self.samples if self.samples else 0.0,
            running=running,
            cpu=cpu,
            queued=queued,
            ahead=self.ahead,
            ahead_seconds=self.ahead_seconds,
            ahead_waited=self.ahead_waited,
        )
        self.windows += 1
        self.starving = window.wait_share > STARVED
        if self.memory_budget is not None and (
            self.memory is None
            or self.measured_memory_at is None
            or now - self.measured_memory_at >= MEMORY_SECONDS
        ):
            self.measured_memory_at = now
            self.memory = self._workers_memory_holds(executor)
        self._restart()
        self.last = now
        if self.prefetcher is not None and self._tune_prefetch(driver, state, window, running):
            return
        if not self.tunes_workers:
            return
        budget = WorkerBudget(self.slots, self.cpus, self.memory)
        tuner, decision = self.decide(self.tuner, window, budget)
        self.latest = decision.why
        if decision.move is TuningMove.HOLD:
            self.tuner = tuner
            return
        before = running
        try:
            for _ in range(decision.workers):
                workers = driver.state.life.workers
                if decision.move is TuningMove.ADD:
                    driver.add(workers.index(_STOPPED))
                    running += 1
                else:
                    active = [
                        w
                        for w, s in enumerate(workers)
                        if s is _ACTIVE and w != driver.state.drawing_for
                    ]
                    driver.retire(active[-1])
                    running -= 1
        except (ProtocolError, ValueError, IndexError) as refused:
            # The scheduler refused (no slot left to add, the last worker): the workers it
            # changed before (of several) stay changed.
            self.latest = f"{decision.why}; not done: {refused}"
            if running == before:
                return
        self.tuner = tuner
        self.workers = running
        self.changed_at = self.batch
        self.records.append(
            TuningRecord(
                self.batch,
                state.life.epoch,
                decision.move,
                running,
                decision.why,
                abs(running - before),
            )
        )

    def _tune_prefetch(self, driver: Any, state: State, window: LoadWindow, running: int) -> bool:
        """Ask the prefetch policy and carry out its change; whether it made one."""
        assert self.prefetcher is not None
        spent = self.memory is not None and running >= self.memory
        prefetcher, decision = self.decide_prefetch(
            self.prefetcher, window, PrefetchBudget(MOST_PREFETCH, spent)
        )
        if decision.move is TuningMove.HOLD:
            self.prefetcher = prefetcher
            if not self.tunes_workers:
                self.latest = decision.why
            return False
        try:
            driver.prefetch(decision.prefetch)
        except ProtocolError as refused:
            # Refused (an index drawn for a worker the lower bound would leave over it): the
            # next window asks again.
            self.latest = f"{decision.why}; not done: {refused}"
            return False
        self.prefetcher = prefetcher
        self.latest = decision.why
        self.changed_at = self.batch
        self.records.append(
            TuningRecord(
                self.batch,
                state.life.epoch,
                decision.move,
                running,
                decision.why,
                0,
                decision.prefetch,
            )
        )
        return True


def _available_memory() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpu_seconds(executor: Any) -> dict[int, tuple[float, float | None]] | None:
    """By thread id for this process's threads (the training loop, worker threads), by pid for
    the executor's worker processes: the CPU seconds used so far, and the seconds spent ready
    to run but waiting for a core (the run queue's delay; None where the kernel does not say).
    None where the workers run elsewhere (Ray) and cannot be counted. Two readings are compared
    over the ids in both, so a thread or process that began or ended between them is left out
    rather than taking its whole life's time with it.

    Read from /proc/PID/schedstat (nanoseconds, one read a worker: a worker process loads in
    its main thread) where the kernel keeps it, else from /proc/PID/stat (CPU time alone, in
    clock ticks of 10 ms: coarse against a window of 20 ms)."""
    while hasattr(executor, "inner"):
        executor = executor.inner
    processes = getattr(executor, "processes", None)
    if processes is None and getattr(executor, "threads", None) is None:
        return None  # neither processes of this machine nor threads of this process
    used: dict[int, tuple[float, float | None]] = dict(_own_threads())
    if not used:
        used[os.getpid()] = (time.process_time(), None)
    if isinstance(processes, dict):
        for process in list(processes.values()):
            pid = getattr(process, "pid", None)
            if pid is None:
                continue
            reading = _schedstat(f"/proc/{pid}/schedstat")
            if reading is not None:
                used[pid] = reading
                continue
            cpu = _stat_cpu(pid)
            if cpu is not None:
                used[pid] = (cpu, None)
    return used


def _schedstat(path: str) -> tuple[float, float] | None:
    """The seconds the thread `path` (a schedstat file: on-CPU ns, run-queue ns, time slices)
    has run and has waited in the run queue so far; None where it cannot be read."""
    try:
        with open(path) as schedstat:
            ran, waited = schedstat.read().split()[:2]
        return int(ran) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return None


def _own_threads() -> dict[int, tuple[float, float]]:
    """`_schedstat` of every thread of this process (the training loop, and worker threads),
    by thread id; empty where the kernel does not say."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return {}
    readings = {int(task): _schedstat(f"/proc/self/task/{task}/schedstat") for task in tasks}
    return {task: reading for task, reading in readings.items() if reading is not None}


def _stat_cpu(pid: int) -> float | None:
    """The CPU seconds process `pid` has used so far, from /proc/PID/stat; None if unread."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # After the command's closing parenthesis: utime and stime are fields 14, 15.
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _cores_used(
    began: dict[int, tuple[float, float | None]] | None,
    ended: dict[int, tuple[float, float | None]] | None,
    seconds: float,
) -> tuple[float | None, float | None]:
    """`LoadWindow`'s `cpu` and `queued` between two `_cpu_seconds` readings `seconds` apart,
    counting the processes in both: the cores kept busy, and the cores' worth of time spent
    waiting in the run queue (None where a reading lacks it)."""
    if began is None or ended is None or seconds <= 0:
        return None, None
    both = began.keys() & ended.keys()
    used = sum(ended[pid][0] - began[pid][0] for pid in both)
    waited: float | None = 0.0
    for pid in both:
        before, after = began[pid][1], ended[pid][1]
        if waited is None or before is None or after is None:
            waited = None
            break
        waited += after - before
    queued = None if waited is None else max(waited, 0.0) / seconds
    return max(used, 0.0) / seconds, queued


def _worker_pids(executor: Any) -> list[int] | None:
    """The pids of the executor's worker processes; None where they are not processes of this
    machine (threads, Ray)."""
    while hasattr(executor, "inner"):  # a pin stage: the workers are its inner executor's
        executor = executor.inner
    processes = getattr(executor, "processes", None)
    if not isinstance(processes, dict):
        return None
    pids = (getattr(process, "pid", None) for process in list(processes.values()))
    return [pid for pid in pids if pid is not None]


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _largest_resident(executor: Any) -> int | None:
    """The largest resident set size (bytes) of the executor's worker processes, from
    /proc/PID/statm: never below a process's proportional set size (a page shared with others
    counts whole, not its share), and read without walking the page tables. None where the
    workers are not processes of this machine or cannot be read."""
    largest = None
    for pid in _worker_pids(executor) or ():
        try:
            with open(f"/proc/{pid}/statm") as statm:
                size = int(statm.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            continue
        largest = size if largest is None else max(largest, size)
    return largest


def _largest_footprint(executor: Any) -> int | None:
    """The largest proportional set size (bytes) of the executor's worker processes; None
    where they are not processes of this machine (threads, Ray) or cannot be read."""
    pids = _worker_pids(executor)
    if pids is None:
        return None
    largest = None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                for line in rollup:
                    if line.startswith("Pss:"):
                        size = int(line.split()[1]) * 1024
                        largest = size if largest is None else max(largest, size)
                        break
        except (OSError, ValueError):
            continue
    return largest
