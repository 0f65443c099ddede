"""How many workers should load: the policy of `num_workers="auto"`, as a pure function.

The loader (the shell) measures, over a window of its latest batches, how long the training
loop waited on loading, how fast batches came and how busy the running workers were; between
two `next()` calls it hands that `LoadWindow` to `decide_workers`, with the `WorkerBudget` it
may spend and the `Tuner` value `decide_workers` returned last time. It answers with the next
`Tuner` and a `TuningDecision`: add a worker, retire one, or hold, each with the reason in
words. Nothing here
reads a clock, a file or the scheduler's state: every figure comes in as a value, so the
policy is tested on recorded and made-up traces alone (tests/test_tuning_policy.py).

The rules, in the order `decide_workers` asks them:

1. Cool-down. A window that began less than `Tuning.cooldown` batches after the last change
   (or before it took effect) tells nothing of the new count: hold.
2. A pause. A window in which one gap between the consumer's requests took most of its time
   (the training loop stopped asking: an evaluation, a checkpoint) says nothing of loading:
   hold, and do not count it toward settling.
3. Judging the last change. An add is kept only if batches came faster by `min_gain` (more
   past the CPU budget, where another worker competes with the others and with the training
   loop for cores: where measured, once they ask for `cpu_full` of the cores, not merely once
   there are more workers than cores) than over every window measured at the count before it
   (`Tuner.pooled`: batches summed over seconds summed, so one short window, an outlier either
   way, does not decide alone; the batches an epoch's start-up loaded ahead, which come at once,
   are left out, `LoadWindow.ahead`; a starving loop's jump into cores measured to have room, made
   on less than `judge_seconds` of them, is undone only if batches came slower by
   `min_gain`), or if the loop waited half as much as before and batches came no slower
   beyond the band of the gain asked (the add fed the loop and took no core from it, its gain
   within the noise; where one window's rate says slower, one more is taken and the two
   pooled decide: `Tuner.second_look`); otherwise it is undone and the count it reached
   becomes a ceiling. One window that says the add brought less than asked but cost no more
   than a window's wobble (`noise_band`) does not undo it alone either: one more window is
   taken and the two pooled decide, since an undo sets a ceiling for the loader's life. Not
   while the loop still starves (waits more than `starved_above`) and the cores are measured
   to have room (`cores_wanted`, what the loop and its workers asked for, busy on the cores or
   waiting in the run queue for them, is under `cpu_full` of them): a starved loop is not
   served by fewer workers, so a slower window is noise, and the add is kept. A retire that
   left the training loop waiting is undone and the count it left becomes a floor. So is an
   undo whose count, measured again over `judge_seconds`, no longer makes batches at the rate
   the undo was judged against (beyond `noise_band`, either way): the machine's speed moved
   between the windows, and the ceiling set on them goes (`_baseline_moved`); the add tried
   once more is the second reversal, so the tuner locks where it lands.
4. Settled. Once waiting stayed negligible for `calm_windows` windows, or the budget is
   spent (the slots, the memory, or a ceiling), the tuner holds; it wakes only if the loop
   waits more than `wake_above` (well above the threshold of adding) for `wake_windows`
   windows in a row: a sudden slowdown. Waking while the loop starves and the cores are
   measured to have room drops the ceiling: it was set on noise, or the load changed.
5. Adding, while the loop waits more than `add_above` of its time and the budget allows: one
   worker, or, while it starves (waits more than `starved_above`), as many as its waiting calls
   for (`_starved_add`: the loop used `1 - wait` of its time, so `running / (1 - wait)` workers
   would keep it fed if loading scales), within the room the cores have left (each running
   worker measured to ask for `cores_wanted / running` of them, the loop's share with it), the
   budget and the ceiling; doubling where the cores are not measured. Where its workers sleep
   (over `asleep_above` of their time with a task in hand), filling the cores on average leaves
   them idle whenever enough sleep at once: the jump goes as far as the count that keeps
   `sleepers_busy` of the cores busy (`core_use`, the cores' use by workers that alternate a
   sleep and a computation, with the two measured over the window), if the waiting calls for
   that many; not where the run queue says other work shares the machine (`shared_above`). Where
   the cores are asked for in full already, half as many again are tried (at least one), and
   judged as any add by rule 3: more workers add loading there only where samples also wait (on
   I/O, or behind a shared machine's other work). Where they are given in full as well (busy on
   `cpu_given` of them, measured with the run queue), the machine is the loader's and nothing is
   tried: the CPU budget is spent, and the tuner settles; unless the workers sleep
   (`asleep_above` of their time with a task in hand, neither on a core nor waiting for one)
   while the cores given still idle (`idle_above`): the cores then idle whenever enough of the
   workers sleep at once, and the tuner fills the gap, as many workers as the idle cores would
   keep busy at the CPU each running worker took (at least one), asked `fill_gain` (it takes an
   idle core's time, not the others'). One at a time, so that a try that does not pay costs one
   worker's memory, not half as many again. An add undone undoes all it added.
6. Retiring, while waiting is negligible and the running workers' load would fit in one fewer,
   each then busy less than `retire_busy` of the time.

The prefetch bound (`prefetch_factor="auto"`) has its own policy, `decide_prefetch`, over the
same windows: it raises the bound while the loop waits and the workers sit idle (each has
answered what it was given and waits for room: in order, behind one slow batch), doubling
while the loop starves; a raise that brought no faster batches while the loop still waits
stops the raising there (a ceiling); and it lowers the bound by one while memory is the budget
(the workers' measured footprint fills it), making that a ceiling. It never changes the workers.

Hysteresis: the thresholds are apart (add over 10% waiting, settle under 2%, wake over 25%),
each change is followed by a cool-down, and a change in the opposite direction to the one
before (a reversal) narrows the range for good (a ceiling or a floor); after `max_reversals`
reversals the tuner is locked where it stands. So however the figures wobble, it makes at
most `(max_reversals + 1) * (slots - 1)` changes over a loader's life (`tuning_change_bound`).
"""

from __future__ import annotations

import enum
import math

import attrs

__all__ = [
    "WorkerBudget",
    "TuningDecision",
    "TuningMove",
    "Tuner",
    "Tuning",
    "LoadWindow",
    "tuning_change_bound",
    "decide_workers",
    "PrefetchBudget",
    "PrefetchDecision",
    "PrefetchTuner",
    "PrefetchTuning",
    "decide_prefetch",
    "prefetch_change_bound",
]


class TuningMove(enum.Enum):
    """What the tuner asks of the loader."""

    ADD = "add"
    """Start one more worker (a retired slot)."""
    RETIRE = "retire"
    """Retire one worker: it finishes what it holds and stops."""
    HOLD = "hold"
    """Change nothing."""
    RAISE_PREFETCH = "raise prefetch"
    """Let each worker hold more tasks (`decide_prefetch` only)."""
    LOWER_PREFETCH = "lower prefetch"
    """Let each worker hold fewer tasks (`decide_prefetch` only)."""

    def __repr__(self) -> str:
        return f"TuningMove.{self.name}"


@attrs.frozen
class LoadWindow:
    """What the loader measured over its latest batches, all after the last change took effect.

    Times are seconds of the consumer's clock; the shell measures them, the policy only divides.
    """

    batch: int
    """Batches handed over in the loader's life when the window ended (its own clock)."""
    batches: int
    """Batches the window covers."""
    seconds: float
    """How long they took, from the window's first request to its last batch."""
    waited: float
    """Of which the training loop spent waiting inside `next()`."""
    longest_gap: float
    """The longest time between a batch handed over and the next request (the loop's own work
    on one batch, or a pause)."""
    busy: float
    """The share of the window the running workers had a task in hand, averaged over them
    (0 to 1)."""
    running: int
    """Workers taking tasks during the window."""
    cpu: float | None = None
    """Cores kept busy over the window by this process (the training loop, and worker threads)
    and its worker processes: CPU seconds over the window's seconds; None where not measured."""
    queued: float | None = None
    """Cores' worth of time the same threads spent ready to run but waiting for a core (the run
    queue's delay, over the window's seconds); None where not measured. On a machine shared
    with other work the loader's processes are given less than they ask for, and what they
    were given (`cpu`) looks like room: what they asked for is `cpu + queued`."""
    ahead: int = 0
    """Of `batches`, the first ones the workers loaded before the window began: an epoch's
    first window, measured from its second batch, begins with those in flight as its first was
    handed over, loaded while that one waited for the workers' start-up. They come at once, so
    they are left out of `rate` (2 workers of `mixed` under a busy training process made
    166-172 batches/s, and a first window counting them said 298.7)."""
    ahead_seconds: float = 0.0
    """The seconds from the window's first request to the last of the `ahead` batches."""
    ahead_waited: float = 0.0
    """Of which the training loop spent waiting inside `next()`."""

    @property
    def first(self) -> int:
        """The batch number the window began at."""
        return self.batch - self.batches

    @property
    def wait_share(self) -> float:
        """The share of the loop's time spent waiting on loading."""
        return self.waited / self.seconds if self.seconds > 0 else 0.0

    @property
    def loading_batches(self) -> int:
        """The batches the workers loaded within the window: all but the `ahead` ones."""
        return self.batches - self.ahead

    @property
    def loading_seconds(self) -> float:
        """The seconds those took: from the last `ahead` batch to the window's end."""
        return self.seconds - self.ahead_seconds

    @property
    def loading_waited(self) -> float:
        """Of which the training loop spent waiting inside `next()`."""
        return self.waited - self.ahead_waited

    @property
    def rate(self) -> float:
        """Batches per second the workers made over the window (the `ahead` ones left out);
        0.0 where every batch of it was loaded before it began."""
        seconds = self.loading_seconds
        return self.loading_batches / seconds if seconds > 0 else 0.0

    @property
    def asleep(self) -> float | None:
        """The share of the window each running worker, on average, had a task in hand but was
        neither on a core nor waiting for one (asleep: on I/O, a sleep, a lock); None where
        the run queue is not measured. The loop's own CPU is counted as the workers', which
        errs on the side of less asleep."""
        if self.cpu is None or self.queued is None or self.running <= 0:
            return None
        return self.busy - (self.cpu + self.queued) / self.running

    @property
    def cores_wanted(self) -> float | None:
        """Cores the loop and its workers kept busy or waited for over the window: the CPU they
        asked for, whether the machine gave it or not; None where not measured."""
        if self.cpu is None:
            return None
        return self.cpu + (self.queued or 0.0)


@attrs.frozen
class WorkerBudget:
    """What the tuner may spend."""

    slots: int
    """The most workers the loader can run: its worker slots."""
    cpus: int
    """The cores this process may use. Past them, an added worker must pay more to be kept."""
    memory: int | None = None
    """The most workers the memory budget holds (a share of available memory over a worker's
    measured footprint); None where it is not measured (threads share one process)."""

    @property
    def limit(self) -> int:
        """The most workers the budget allows now."""
        return self.slots if self.memory is None else max(1, min(self.slots, self.memory))

    def spent_by(self, running: int) -> str | None:
        """Which budget `running` workers spend, in words, or None if some is left."""
        if running < self.limit:
            return None
        if self.memory is not None and self.memory <= self.slots:
            return f"the memory budget holds {self.limit} worker(s)"
        return f"every one of the {self.slots} worker slots runs"


@attrs.frozen
class Tuning:
    """The policy's thresholds. The defaults are the loader's."""

    add_above: float = 0.10
    """Add a worker while the training loop waits more than this share of its time."""
    calm_below: float = 0.02
    """Waiting under this share is negligible."""
    wake_above: float = 0.25
    """A settled tuner changes again only while the loop waits more than this."""
    retire_busy: float = 0.6
    """Retire one worker where the running workers' load, spread over one fewer, keeps each
    busy under this share."""
    cooldown: int = 8
    """Batches after a change during which nothing is measured: a window must begin this many
    batches after it. An added worker's first batches, and the batches queued behind them,
    come late, and would make any add look as if it did not pay."""
    calm_windows: int = 3
    """Windows of negligible waiting in a row after which the tuner settles."""
    wake_windows: int = 2
    """Windows over `wake_above` in a row that wake a settled tuner."""
    min_gain: float = 0.04
    """An add is kept only if batches came faster by this share."""
    min_gain_past_cpus: float = 0.06
    """The same, for workers past the CPU budget (up to half as many again as ran before; in
    proportion for more): where the cores are measured, once the loop and its workers ask for
    `cpu_full` of them; where not, once more workers run than cores.
    Not 8%: on `mixed` (quiet machine) 8% undid 6 -> 9 workers, which brought 6.7%; a busy
    training loop's third worker, 5% within a shared machine's noise, is still undone."""
    starved_above: float = 0.5
    """While the loop waits more than this share, adding doubles the count, and an add is not
    undone unless the cores are measured full: waiting that much is not noise."""
    max_reversals: int = 2
    """Changes against the one before after which the tuner is locked where it stands."""
    pause_share: float = 0.5
    """A window whose longest gap between requests took more than this share of its time is a
    pause of the training loop, and tells nothing of loading."""
    judge_seconds: float = 0.5
    """An add is undone only on a window at least this long: a shorter one (a starving loop's
    16 batches, tens of milliseconds) moves by more than the gain asked on a shared machine.
    Where such a window says the add did not pay, the policy holds (`Tuner.judging`) and the
    loader measures the next window over this long, which judges it."""
    cpu_full: float = 0.9
    """The CPU budget is spent once the loop and its workers ask for this share of the cores
    (`LoadWindow.cores_wanted`: busy on them, or waiting in the run queue for them): another
    worker would take a core from them, not add one."""
    cpu_given: float = 0.85
    """The CPU budget is spent, and no worker tried, once the loop and its workers asked for
    `cpu_full` of the cores and were given this share of them (busy on them, measured with the
    run queue): the machine is the loader's. Under `cpu_full`, since the loader's processes
    wait for one another in the run queue (the main process wakes for each batch while every
    worker computes): cpu-spin's two workers and loop were busy on 1.78 to 1.89 of 2 cores
    over half-second windows of a lightly loaded machine."""
    asleep_above: float = 0.2
    """The cores given in full settle the tuner only where its workers compute whenever they
    have a task: where they spend more than this share of the window with one in hand but
    neither on a core nor waiting for one (`LoadWindow.asleep`: on I/O, a sleep), the cores
    idle whenever enough of them sleep at once, and one more worker fills the gap. `mixed`
    (2 ms asleep, 1 ms of a core, a sample) at 7 workers, quiet: asleep about 50% of the
    time, the cores given 1.80 of 2, and 8 fixed workers 5% faster than 7. cpu-spin's windows,
    loaded or not: -0.1 to 0.05 over half a second."""
    idle_above: float = 0.02
    """...and while the cores given leave more than this share of them idle."""
    noise_band: float = 0.06
    """One half-second window's rate, at a count that does not change, wobbles this much: an
    add judged on one window whose batches came slower than the rate before by less than this
    is not known to have cost anything, and one more window is taken before it is undone
    (`Tuner.second_look`). `mixed` at 5 workers, quiet (2026-11-28): windows from 284 to 337
    batches/s, 6% either side of their mean; 5 -> 7 there came at 336.4 -> 327.6, was undone
    under the 6% asked, and the tuner settled at 5 for the run (305.9 batches/s, against 411
    for a run that kept it)."""
    fill_gain: float = 0.02
    """The gain asked of workers that filled such a gap: the cores idled 8-10% on `mixed`, so
    a filling worker brings a few percent at most (7 -> 8 and 8 -> 9 brought 3.2% and 3.5%
    there, quiet, where 16 workers were 5% faster than 8)."""
    sleepers_busy: float = 0.95
    """A starving loop's jump, where its workers sleep (`asleep_above`), goes as far as the
    count whose workers would keep this share of `cpu_full` of the cores busy (`core_use`). The
    room the cores have left, counted as if each worker asked for its share of them all the
    time, took `mixed` from 2 workers to 4-5, then half a second at each count to 8: 3.6% of
    a 2,400-batch run. Sized by `core_use` from the first 16 batches (2 workers, asleep 52-67%
    of the time), it went to 6-8 at once (12 rounds in turns, quiet: 0.953 of the best fixed
    count against 0.909)."""
    shared_above: float = 0.25
    """The sleepers' jump counts on the cores being the loader's: where its processes waited in
    the run queue more than its workers' own sleep and computation would make them wait for
    one another (`core_use`'s model at the running count), by over this share of the CPU they
    were given, other work shares the machine, and the jump is the cores' room alone. Quiet,
    `mixed`'s windows waited 0.02 to 0.11 cores' worth beyond the model at 2 to 7 workers
    (0.03 to 0.11 of their CPU); with other sessions taking a core, 0.39 beyond it (0.9)."""


@attrs.frozen
class Tuner:
    """What the policy remembers between decisions. `Tuner()` before the first."""

    changed_at: int = 0
    """The batch number of the last change."""
    added: int = 1
    """Workers the last add started (undoing it retires them all)."""
    last: TuningMove = TuningMove.HOLD
    """The direction of the last change (HOLD before the first)."""
    judged: bool = True
    """The last change has been judged (kept, or undone)."""
    judging: bool = False
    """A short window said the last add did not pay: the next window, over at least
    `Tuning.judge_seconds` (the loader reads this), judges it."""
    rate_before: float = 0.0
    """Batches per second over the windows measured at the count before the last change
    (`pooled_rate` as it was made)."""
    wait_before: float = 0.0
    """The loop's share of time waiting over those windows."""
    second_look: bool = False
    """One window could not settle the last add: the loop waited half as much after it but
    batches came slower beyond the band of the gain asked, or they came under the gain asked
    but slower by less than `Tuning.noise_band`. The add is judged on the windows since it,
    pooled, one window later (over `Tuning.judge_seconds`: the loader reads `long_window`)."""
    jumped: bool = False
    """The last add was a starving loop's jump into cores measured to have room, made on
    windows shorter than `Tuning.judge_seconds` (16 batches): they cannot say it brought no
    gain, only that it made batches slower."""
    ceiling: int | None = None
    """The most workers worth running: an add past it did not pay."""
    floor: int = 1
    """The fewest workers enough: a retire under it left the training loop waiting."""
    reversals: int = 0
    calm: int = 0
    """Windows of negligible waiting in a row."""
    loud: int = 0
    """Windows over `Tuning.wake_above` in a row, while settled."""
    settled: bool = False
    locked: bool = False
    """Settled for good: `Tuning.max_reversals` reversals were made."""
    changes: int = 0
    filling: bool = False
    """The last add filled the idle gaps of cores given in full (rule 5): it is asked the plain
    `Tuning.min_gain`, not the gain asked past the cores."""
    measuring: bool = False
    """An add past the cores was called for, but the windows at the running count covered
    less than `Tuning.judge_seconds`: the next window, that long, measures the count first."""
    seen_batches: int = 0
    """Batches of the windows measured at the running count since the last change (or since
    a settled tuner woke)."""
    seen_seconds: float = 0.0
    """Their seconds."""
    seen_waited: float = 0.0
    """The loop's waiting in them."""

    @property
    def long_window(self) -> bool:
        """Whether the next window must cover `Tuning.judge_seconds` (the loader reads this):
        a judgement a short window could not make, or could not make alone, or a count to
        measure before an add."""
        return self.judging or self.second_look or self.measuring

    def pooled(self, window: LoadWindow) -> Tuner:
        """With `window` counted among those at the running count: the batches the workers
        loaded in it (`LoadWindow.ahead` left out), the rate a change is judged against."""
        return attrs.evolve(
            self,
            seen_batches=self.seen_batches + window.loading_batches,
            seen_seconds=self.seen_seconds + window.loading_seconds,
            seen_waited=self.seen_waited + window.loading_waited,
        )

    @property
    def pooled_rate(self) -> float:
        """Batches per second over the windows at the running count."""
        return self.seen_batches / self.seen_seconds if self.seen_seconds > 0 else 0.0

    @property
    def pooled_wait(self) -> float:
        """The loop's share of their time spent waiting."""
        return self.seen_waited / self.seen_seconds if self.seen_seconds > 0 else 0.0

    def before_change(self) -> Tuner:
        """Remembers the pooled windows as the figures the next change is judged against."""
        return attrs.evolve(self, rate_before=self.pooled_rate, wait_before=self.pooled_wait)


@attrs.frozen
class TuningDecision:
    """The tuner's answer, with its reason in words (for `stats()` and the verdict)."""

    move: TuningMove
    why: str
    workers: int = 1
    """How many workers to add or retire."""

    @property
    def changes(self) -> bool:
        return self.move is not TuningMove.HOLD


def tuning_change_bound(slots: int, tuning: Tuning = Tuning()) -> int:
    """The most changes the tuner makes over a loader's life with `slots` worker slots."""
    return (tuning.max_reversals + 1) * max(slots - 1, 0)


def decide_workers(
    tuner: Tuner, window: LoadWindow, budget: WorkerBudget, tuning: Tuning = Tuning()
) -> tuple[Tuner, TuningDecision]:
    """The next `Tuner` and the decision for `window` (see the module docstring)."""
    running = window.running
    if tuner.changes and window.first < tuner.changed_at + tuning.cooldown:
        return tuner, _hold("cooling down after the last change")
    if window.batches < 2 or window.seconds <= 0:
        return tuner, _hold("too few batches to tell")
    if window.longest_gap > tuning.pause_share * window.seconds:
        return tuner, _hold(
            "the training loop paused between two batches: the window tells nothing of loading"
        )
    wait = window.wait_share
    tuner = tuner.pooled(window)

    if not tuner.judged:
        tuner, undo = _judge(tuner, window, budget, tuning)
        if undo is not None:
            return tuner, undo

    if tuner.locked:
        return tuner, _hold(f"locked at {running} worker(s) after {tuner.reversals} reversals")
    over_memory = budget.memory is not None and running > budget.limit
    if over_memory:
        return _change(
            tuner,
            TuningMove.RETIRE,
            window,
            tuning,
            f"the memory budget holds {budget.limit} worker(s), and {running} run",
        )

    if tuner.settled:
        if wait <= tuning.wake_above:
            return attrs.evolve(tuner, loud=0), _hold(f"settled at {running} worker(s)")
        loud = tuner.loud + 1
        if loud < tuning.wake_windows:
            return attrs.evolve(tuner, loud=loud), _hold(
                f"settled at {running} worker(s); the training loop waited {wait:.0%}"
            )
        # A ceiling set while the cores had room was noise: a starved loop wakes past it.
        spare = _cores_have_room(window, budget, tuning)
        ceiling = None if spare and wait > tuning.starved_above else tuner.ceiling
        # Woken, the load has changed: the windows of the settled stretch are not this one's.
        tuner = attrs.evolve(
            tuner,
            settled=False,
            loud=0,
            calm=0,
            ceiling=ceiling,
            seen_batches=0,
            seen_seconds=0.0,
            seen_waited=0.0,
        ).pooled(window)

    calm = tuner.calm + 1 if wait < tuning.calm_below else 0
    tuner = attrs.evolve(tuner, calm=calm)
    if wait > tuning.add_above:
        spent = budget.spent_by(running)
        ceiling = tuner.ceiling
        if spent is None and ceiling is not None and running >= ceiling:
            spent = f"adding past {ceiling} worker(s) did not pay earlier"
        if spent is not None:
            return attrs.evolve(tuner, settled=True), _hold(
                f"the training loop waited {wait:.0%}, and {spent}: settled at {running} worker(s)"
            )
        left = budget.limit - running
        if ceiling is not None:
            left = min(left, ceiling - running)
        wanted = window.cores_wanted
        why = f"the training loop waited {wait:.0%} of its time on loading"
        filling = jumped = False
        if wanted is not None and wanted >= tuning.cpu_full * budget.cpus:
            given = _cores_given_in_full(window, budget, tuning)
            filling = given and _sleepers_leave_cores_idle(window, budget, tuning)
            if given and not filling:
                # The cores are not only asked for but given: the machine is the loader's and
                # it computes on all of it. Another worker would take a core's slices from the
                # others, and its try would cost a start, a cool-down and a half-second
                # judgement at a count that cannot be faster.
                return attrs.evolve(tuner, settled=True), _hold(
                    f"the training loop waited {wait:.0%}, and {_cpu_given(window, budget)}: "
                    f"settled at {running} worker(s)"
                )
            if tuner.seen_seconds < tuning.judge_seconds:
                # An add past the cores is judged against the count before it, and a starving
                # loop's windows are 16 batches: one at 533.6 batches/s on `mixed`, faster than
                # 16 fixed workers ever ran, undid adds that paid. The count is measured over
                # `judge_seconds` first (the loader reads `Tuner.long_window`).
                return attrs.evolve(tuner, measuring=True), _hold(
                    f"{why}, and {_cpu_spent(window, budget)}: measuring {running} worker(s) "
                    "over a longer window before trying more"
                )
            if filling:
                # Given nearly in full, to workers that sleep part of each task: the cores
                # idle whenever enough of them sleep at once. As many more as the idle cores
                # would keep busy fill the gap; half as many again took `mixed` to 13-16
                # workers where 8 were as fast, and twice the memory. (Not `core_use`: the
                # share asleep, what is left of the workers' time after the CPU and the run
                # queue, moves too much once they queue for the cores: 7 workers of `mixed` were
                # measured asleep 34% in one recorded window, 49% in another.)
                adding = _fill_add(window, budget, left)
                why += (
                    f", and its workers slept {window.asleep or 0.0:.0%} of their time while "
                    f"the loop and its workers kept {window.cpu or 0.0:.2f} of {budget.cpus} "
                    f"cores busy: the cores idle when too many sleep at once; adding {adding}"
                )
            else:
                # The cores are asked for in full: another worker adds loading only where
                # samples also wait (on I/O, or behind the machine's other work, whose share
                # more workers take). Try half as many again, judged as every add: kept only if
                # batches come faster, else undone and the count before it a ceiling.
                adding = max(1, min(running // 2, left))
                why += f", and {_cpu_spent(window, budget)}: trying {adding} more"
        elif wait > tuning.starved_above:
            adding = _starved_add(running, left, wait, wanted, budget, tuning)
            sleepers = _sleepers_need(window, budget, tuning)
            if sleepers is not None and sleepers - running > adding:
                adding = max(adding, min(sleepers - running, _fed_by(running, wait), left))
                why += (
                    f", and its workers slept {window.asleep or 0.0:.0%} of their time: "
                    f"{sleepers} would keep the cores busy; adding {adding}"
                )
            jumped = wanted is not None and tuner.seen_seconds < tuning.judge_seconds
        else:
            adding = 1
        tuner, decision = _change(
            tuner.before_change(), TuningMove.ADD, window, tuning, why, adding
        )
        return attrs.evolve(tuner, filling=filling, jumped=jumped), decision
    busy = window.busy
    if (
        wait < tuning.calm_below
        and running > tuner.floor
        and busy * running <= (running - 1) * tuning.retire_busy
    ):
        return _change(
            tuner.before_change(),
            TuningMove.RETIRE,
            window,
            tuning,
            f"the workers were busy {busy:.0%} of the time and the training loop did not wait",
        )
    if calm >= tuning.calm_windows:
        return attrs.evolve(tuner, settled=True), _hold(
            f"waiting was negligible ({wait:.1%}) for {calm} windows: settled at {running} "
            "worker(s)"
        )
    return tuner, _hold(f"the training loop waited {wait:.0%}: nothing to change")


def _cores_have_room(window: LoadWindow, budget: WorkerBudget, tuning: Tuning) -> bool:
    """Whether the loop and its workers asked for less than `cpu_full` of the cores (False
    where not measured): what they asked for, not what they were given, since on a shared
    machine what they were given says how busy the others are."""
    wanted = window.cores_wanted
    return wanted is not None and wanted < tuning.cpu_full * budget.cpus


def _cores_given_in_full(window: LoadWindow, budget: WorkerBudget, tuning: Tuning) -> bool:
    """Whether the loop and its workers were given the cores (`cpu_given` of them), not only
    asked for them: busy on them, measured in nanoseconds with the run queue (`queued` not None).
    Where the run queue is not measured the CPU time is read in clock ticks of 10 ms, too
    coarse over a starving loop's window of tens of milliseconds to say the machine is full."""
    return (
        window.queued is not None
        and window.cpu is not None
        and window.cpu >= tuning.cpu_given * budget.cpus
    )


def _sleepers_leave_cores_idle(window: LoadWindow, budget: WorkerBudget, tuning: Tuning) -> bool:
    """Whether the cores given in full still idle (more than `idle_above` of them) under
    workers that sleep (over `asleep_above` of their time with a task in hand): more workers
    would fill the gaps."""
    asleep = window.asleep
    return (
        asleep is not None
        and asleep > tuning.asleep_above
        and (window.cpu or 0.0) < (1 - tuning.idle_above) * budget.cpus
    )


def _fill_add(window: LoadWindow, budget: WorkerBudget, left: int) -> int:
    """Workers that would keep the idle cores busy, each taking the CPU a running worker took
    (the loop's counted with theirs, which errs on the side of fewer): at least one, within
    `left`."""
    cpu = window.cpu or 0.0
    if cpu <= 0:
        return 1
    idle = budget.cpus - cpu
    return max(1, min(round(idle * window.running / cpu), left))


def _sleepers_chain(workers: int, sleep_per_cpu: float, cores: float) -> tuple[float, float]:
    """The cores' worth that `workers` keep busy and keep waiting in the run queue, each
    alternating a sleep and a computation, the sleep `sleep_per_cpu` times as long, in the
    machine-repairman model: both times exponential, the cores shared among those computing.

    The number computing moves as a birth-death chain (one wakes at `(workers - n) / sleep`,
    one finishes at `min(n, cores) / cpu`); over its stationary weights, `min(n, cores)` is
    busy and the rest, `n - cores` where positive, waits for a core."""
    if workers <= 0 or cores <= 0:
        return 0.0, 0.0
    if sleep_per_cpu <= 0:
        return min(workers, cores), max(workers - cores, 0.0)
    # The stationary weights, unnormalised, from n = 0 (weight 1).
    weight, total, busy, waiting = 1.0, 1.0, 0.0, 0.0
    for n in range(1, workers + 1):
        computing = min(n, cores)
        weight *= (workers - n + 1) / sleep_per_cpu / computing
        total += weight
        busy += weight * computing
        waiting += weight * (n - computing)
        if total > 1e100:
            # Only the ratios count; kept in range for hundreds of workers that barely sleep.
            weight, busy, waiting = weight / total, busy / total, waiting / total
            total = 1.0
    return busy / total, waiting / total


def core_use(workers: int, sleep_per_cpu: float, cores: float) -> float:
    """The share of `cores` that `workers` keep busy, each alternating a sleep and a
    computation, the sleep `sleep_per_cpu` times as long as the computation.

    Counting the cores' use as `workers * cpu_each` leaves out the times when too many sleep
    at once, so it calls for too few workers; the machine-repairman model (`_sleepers_chain`)
    keeps them. It matched `mixed` (2 ms asleep, then 1 ms of a core, a sample) on this
    project's 2 cores, quiet (2026-11-28): 1, 2 and 4 fixed workers made 0.17, 0.33 and 0.63
    of the best count's batches, and the model says 0.17, 0.33 and 0.63 (8: 0.95, where 8 and
    16 made the same); and the run queue it predicts for auto's windows at 5, 6 and 7 workers,
    0.76, 0.92 and 1.64 cores' worth, was measured 0.77, 0.86 and 1.63.
    """
    if cores <= 0:
        return 0.0
    return _sleepers_chain(workers, sleep_per_cpu, cores)[0] / cores


def _sleepers_need(window: LoadWindow, budget: WorkerBudget, tuning: Tuning) -> int | None:
    """The fewest workers that would keep `sleepers_busy` of the cores the loader may ask for
    (`cpu_full` of them) busy, each sleeping and computing as the running ones did over
    `window` (`core_use`), at most `budget.slots`. None where the workers are not measured to
    sleep (`asleep_above`), or where the machine is shared: its processes waited in the run
    queue more than their own sleep and computation explain (`shared_above`), since the model
    counts on the cores being the loader's. Each running worker's CPU is taken as
    `cpu / running`, the loop's counted with theirs, which errs on the side of fewer."""
    asleep, cpu, queued = window.asleep, window.cpu, window.queued
    if asleep is None or cpu is None or queued is None or cpu <= 0:
        return None
    if asleep <= tuning.asleep_above:
        return None
    sleep_per_cpu = asleep / (cpu / window.running)
    _, own_queue = _sleepers_chain(window.running, sleep_per_cpu, budget.cpus)
    if queued - own_queue > tuning.shared_above * cpu:
        return None
    cores = tuning.cpu_full * budget.cpus
    count = window.running
    while count < budget.slots and core_use(count, sleep_per_cpu, cores) < tuning.sleepers_busy:
        count += 1
    return count


def _past_share(added: int, running: int) -> float:
    """How many times `Tuning.min_gain_past_cpus` an add of `added` workers, `running` now,
    is asked past the cores: once for up to half as many again as ran before it, in
    proportion beyond (each competes for the cores and costs its memory: 2 -> 8 workers on
    `mixed`, 7% faster on a loaded machine, is not worth 6 more)."""
    before = max(running - added, 1)
    return max(1.0, added / max(before / 2, 1.0))


def _cpu_given(window: LoadWindow, budget: WorkerBudget) -> str:
    """The cores given in full, in words."""
    return (
        f"the CPU budget is spent (the loop and its workers kept {window.cpu or 0.0:.1f} of "
        f"{budget.cpus} cores busy: another worker would take a core from them)"
    )


def _cpu_spent(window: LoadWindow, budget: WorkerBudget) -> str:
    """The CPU budget spent, in words."""
    kept = f"the loop and its workers kept {window.cpu or 0.0:.1f} of {budget.cpus} cores busy"
    if window.queued:
        kept += f" and waited for {window.queued:.1f} more in the run queue"
    return f"the CPU budget is spent ({kept})"


def _fed_by(running: int, wait: float) -> int:
    """Workers to add to `running` that would feed a loop waiting `wait` of its time, if
    loading scales: it was busy `1 - wait` of its time, so loading `1 / (1 - wait)` times as
    fast feeds it."""
    return math.ceil(running / max(1.0 - wait, 1e-6)) - running


def _starved_add(
    running: int, left: int, wait: float, cpu: float | None, budget: WorkerBudget, tuning: Tuning
) -> int:
    """Workers to add for a loop that starves: as many as its waiting calls for, within the
    room the cores have left (`cpu`: the cores the loop and its workers asked for) and the
    `left` the budget and ceiling allow; where the cores are not measured, as many as run
    (doubling), since nothing says the next ones would get a core. At least one."""
    if cpu is None:
        return max(1, min(running, left))
    wanted = _fed_by(running, wait)
    if cpu > 0:
        # Each running worker took `cpu / running` cores (the loop's share counted with them,
        # which errs on the side of fewer): no more than fit in what the cores have left.
        room = (tuning.cpu_full * budget.cpus - cpu) * running / cpu
        wanted = min(wanted, math.floor(room))
    return max(1, min(wanted, left))


def _judge(
    tuner: Tuner, window: LoadWindow, budget: WorkerBudget, tuning: Tuning
) -> tuple[Tuner, TuningDecision | None]:
    """Keep the last change, or undo it (None: kept)."""
    running = window.running
    an_add = tuner.last is TuningMove.ADD and running > tuner.floor
    if an_add and window.loading_batches == 0:
        # Every batch of the window was loaded before it began (an epoch's start-up): it says
        # nothing of the count's rate. The next one judges.
        return tuner, _hold("the window's batches were loaded before it: judging on the next")
    if an_add and tuner.rate_before > 0:
        # (No rate before: every batch measured at the count before was loaded before its
        # window began. The add, made on the loop's waiting, is kept.)
        # Past the cores: the loop and its workers ask for them in full, where measured (a
        # worker that sleeps on I/O or a busy training loop's third worker takes no core from
        # the others, and the gain a loop waiting 15% can have is 18% at most); else more
        # workers than cores.
        wanted = window.cores_wanted
        past = (
            running > budget.cpus
            if wanted is None
            else not _cores_have_room(window, budget, tuning)
        )
        needed = tuning.min_gain
        if tuner.filling:
            # Workers that filled the idle gaps of cores given in full take an idle core's
            # time, not the others', and can bring no more than the cores idled.
            needed = tuning.fill_gain
        elif past:
            needed = tuning.min_gain_past_cpus * _past_share(tuner.added, running)
        if tuner.jumped:
            # Judged against tens of milliseconds: only a loss beyond the noise undoes it (on
            # `mixed`, 4 -> 5 workers, 298.8 -> 308.2 batches/s, was undone under the 6% asked,
            # and the tuner locked at 5 where 16 were best).
            needed = -tuning.min_gain
        # A starved loop with cores to spare is not served better by fewer workers: a slower
        # window then is noise (a shared machine), not an add that did not pay.
        starved = window.wait_share > tuning.starved_above and _cores_have_room(
            window, budget, tuning
        )
        # The loop waits half as much as before, and batches come no slower beyond the noise
        # band the gain asked is (a share within one window, the waiting is steadier than a
        # rate across two: 2 workers under the busy training step gave 137 to 171 batches/s
        # over half-second windows of the quiet machine): the add fed the loop and took no
        # core from it, though the gain (at most what the loop waited: a few percent for a
        # training step that computes) is within that noise. 2 -> 3 there left the loop
        # waiting 5% against 15%, at 169.6 -> 160.4 batches/s; undone, the tuner settled at 2
        # (149.4 steps/s) where 4 fixed workers made 184.
        # A second look pools the windows since the add (`Tuner.pooled`).
        rate = tuner.pooled_rate if tuner.second_look else window.rate
        halved = window.wait_share <= tuner.wait_before / 2
        fed = halved and rate >= tuner.rate_before * (1 - max(needed, 0.0))
        if rate < tuner.rate_before * (1 + needed) and not starved and not fed:
            if window.seconds < tuning.judge_seconds and not tuner.judging:
                return attrs.evolve(tuner, judging=True), _hold(
                    f"the add looked as if it did not pay ({tuner.rate_before:.1f} -> "
                    f"{window.rate:.1f} batches/s over {window.seconds * 1000:.0f} ms): judging "
                    "it over a longer window"
                )
            if halved and not tuner.second_look:
                # The waiting says the add fed the loop, one rate says batches came slower
                # beyond the noise band: one more window, pooled with this one, decides.
                return attrs.evolve(tuner, second_look=True), _hold(
                    f"the training loop waited {window.wait_share:.0%} against "
                    f"{tuner.wait_before:.0%} before the add, but batches came slower "
                    f"({tuner.rate_before:.1f} -> {rate:.1f} a second): judging it over one "
                    "more window"
                )
            if rate >= tuner.rate_before * (1 - tuning.noise_band) and not tuner.second_look:
                # Under the gain asked, but no slower than one window's wobble: one window
                # cannot tell an add that brought nothing from one that brought the gain
                # asked, and an undo sets a ceiling for the rest of the loader's life.
                return attrs.evolve(tuner, second_look=True), _hold(
                    f"batches came {tuner.rate_before:.1f} -> {rate:.1f} a second, under the "
                    f"{max(needed, 0.0):.0%} gain asked but within one window's noise: judging "
                    "it over one more window"
                )
            added = max(1, min(tuner.added, running - tuner.floor))
            tuner = attrs.evolve(tuner, ceiling=running - added)
            who = f"worker {running}" if added == 1 else f"workers {running - added + 1}-{running}"
            return _change(
                tuner,
                TuningMove.RETIRE,
                window,
                tuning,
                f"{who} did not pay: {tuner.rate_before:.1f} -> {rate:.1f} "
                + (
                    f"batches/s, over the {-needed:.0%} loss allowed against a short window"
                    if needed < 0
                    else f"batches/s, under the {needed:.0%} gain asked"
                ),
                added,
            )
    elif (
        tuner.last is TuningMove.RETIRE
        and window.wait_share > tuning.add_above
        and running < budget.limit
    ):
        why = f"with {running} worker(s) the training loop waited {window.wait_share:.0%}"
        moved = tuner.ceiling == running and _baseline_moved(tuner, window, tuning)
        if moved:
            # The undo compared the add with this count's rate before it; back at this count,
            # batches no longer come at that rate: the machine's speed moved between the
            # windows (a shared machine's dip), and the ceiling was set on it. One more try,
            # the second reversal: the tuner locks wherever it lands.
            why += (
                f", and batches came {tuner.rate_before:.1f} -> {window.rate:.1f} a second at "
                "the same count: the undo was judged on a machine whose speed moved"
            )
            tuner = attrs.evolve(tuner, ceiling=None)
        if tuner.ceiling is None or running < tuner.ceiling:
            tuner = attrs.evolve(tuner, floor=running + 1)
            return _change(tuner, TuningMove.ADD, window, tuning, why)
    return attrs.evolve(tuner, judged=True, judging=False, second_look=False), None


def _baseline_moved(tuner: Tuner, window: LoadWindow, tuning: Tuning) -> bool:
    """Whether `window`, at the count an undo went back to, says batches came at another rate
    than the one the undo was judged against (`Tuner.rate_before`), by more than one window's
    wobble (`noise_band`), measured over `judge_seconds` at least."""
    if window.seconds < tuning.judge_seconds or tuner.rate_before <= 0:
        return False
    return abs(window.rate - tuner.rate_before) > tuning.noise_band * tuner.rate_before


def _change(
    tuner: Tuner,
    move: TuningMove,
    window: LoadWindow,
    tuning: Tuning,
    why: str,
    workers: int = 1,
) -> tuple[Tuner, TuningDecision]:
    reversal = tuner.last is not TuningMove.HOLD and tuner.last is not move
    reversals = tuner.reversals + reversal
    locked = reversals >= tuning.max_reversals
    tuner = attrs.evolve(
        tuner,
        changed_at=window.batch,
        last=move,
        # A locked tuner judges nothing more: an undo would be one more reversal.
        judged=locked,
        judging=False,
        measuring=False,
        reversals=reversals,
        calm=0,
        loud=0,
        settled=False,
        locked=locked,
        changes=tuner.changes + 1,
        added=workers if move is TuningMove.ADD else tuner.added,
        filling=False,
        jumped=False,
        second_look=False,
        seen_batches=0,
        seen_seconds=0.0,
        seen_waited=0.0,
    )
    return tuner, TuningDecision(move, why, workers)


def _hold(why: str) -> TuningDecision:
    return TuningDecision(TuningMove.HOLD, why)


# --- the prefetch bound ---------------------------------------------------------------------------


@attrs.frozen
class PrefetchBudget:
    """What the prefetch tuner may spend."""

    most: int
    """The deepest bound it may set (tasks per worker)."""
    memory_spent: bool = False
    """The workers' measured footprint fills the memory budget: each task a worker holds keeps
    a batch in memory, so the bound is lowered rather than raised."""


@attrs.frozen
class PrefetchTuning:
    """The prefetch policy's thresholds. The defaults are the loader's."""

    raise_above: float = 0.10
    """Raise the bound while the training loop waits more than this share of its time..."""
    idle_above: float = 0.1
    """...and the running workers sit idle (no task in hand) more than this share of it: they
    are waiting for room, not working, so more room is what would keep them busy."""
    starved_above: float = 0.5
    """While the loop waits more than this share, a raise doubles the bound."""
    min_gain: float = 0.04
    """A raise that did not make batches come faster by this share, while the loop still waits,
    is the last: the bound it reached becomes a ceiling."""
    cooldown: int = 8
    """As `Tuning.cooldown`: a window begun this soon after a change tells nothing of it."""
    pause_share: float = 0.5
    """As `Tuning.pause_share`."""


@attrs.frozen
class PrefetchTuner:
    """What the prefetch policy remembers between decisions. `PrefetchTuner(prefetch)` before
    the first, with the bound the loader starts with."""

    prefetch: int = 2
    """The bound in force."""
    changed_at: int = 0
    """The batch number of the last change."""
    changes: int = 0
    judged: bool = True
    """The last raise has been judged."""
    rate_before: float = 0.0
    """Batches per second in the window that led to the last raise."""
    ceiling: int | None = None
    """The deepest bound worth setting: a raise to it did not pay, or memory lowered it."""


@attrs.frozen
class PrefetchDecision:
    """The prefetch tuner's answer, with its reason in words."""

    move: TuningMove
    """`RAISE_PREFETCH`, `LOWER_PREFETCH` or `HOLD`."""
    prefetch: int
    """The bound after it."""
    why: str

    @property
    def changes(self) -> bool:
        return self.move is not TuningMove.HOLD


def prefetch_change_bound(most: int) -> int:
    """The most changes the prefetch tuner makes over a loader's life with bounds up to `most`:
    every lowering lowers the ceiling for good (at most `most - 1` of them), and between two
    the raises climb monotonically (at most `most - 1` each run)."""
    return max(most - 1, 0) * (most + 1)


def decide_prefetch(
    tuner: PrefetchTuner,
    window: LoadWindow,
    budget: PrefetchBudget,
    tuning: PrefetchTuning = PrefetchTuning(),
) -> tuple[PrefetchTuner, PrefetchDecision]:
    """The next `PrefetchTuner` and the decision for `window` (see the module docstring)."""
    now = tuner.prefetch
    if tuner.changes and window.first < tuner.changed_at + tuning.cooldown:
        return tuner, _keep(now, "cooling down after the last change")
    if window.batches < 2 or window.seconds <= 0:
        return tuner, _keep(now, "too few batches to tell")
    if window.longest_gap > tuning.pause_share * window.seconds:
        return tuner, _keep(
            now, "the training loop paused between two batches: the window tells nothing"
        )
    wait, rate = window.wait_share, window.rate
    if budget.memory_spent:
        if now <= 1:
            return tuner, _keep(now, "memory is the budget, and each worker holds one task")
        lower = now - 1
        tuner = attrs.evolve(
            tuner,
            prefetch=lower,
            changed_at=window.batch,
            changes=tuner.changes + 1,
            judged=True,
            ceiling=lower,
        )
        return tuner, PrefetchDecision(
            TuningMove.LOWER_PREFETCH,
            lower,
            "the workers' footprint fills the memory budget, and each task a worker holds "
            "keeps a batch in memory",
        )
    if not tuner.judged:
        if wait > tuning.raise_above and rate < tuner.rate_before * (1 + tuning.min_gain):
            tuner = attrs.evolve(tuner, judged=True, ceiling=now)
            return tuner, _keep(
                now,
                f"raising it to {now} did not pay: {tuner.rate_before:.1f} -> {rate:.1f} "
                f"batches/s, under the {tuning.min_gain:.0%} gain asked",
            )
        tuner = attrs.evolve(tuner, judged=True)
    idle = 1.0 - window.busy
    if wait <= tuning.raise_above:
        return tuner, _keep(now, f"the training loop waited {wait:.0%}: enough in flight")
    if idle <= tuning.idle_above:
        return tuner, _keep(
            now,
            f"the training loop waited {wait:.0%}, and the workers were busy {window.busy:.0%} "
            "of the time: more room would not make them faster",
        )
    cap = budget.most if tuner.ceiling is None else min(budget.most, tuner.ceiling)
    if now >= cap:
        return tuner, _keep(now, f"the training loop waited {wait:.0%}, at the deepest ({cap})")
    deeper = min(2 * now if wait > tuning.starved_above else now + 1, cap)
    tuner = attrs.evolve(
        tuner,
        prefetch=deeper,
        changed_at=window.batch,
        changes=tuner.changes + 1,
        judged=False,
        rate_before=rate,
    )
    return tuner, PrefetchDecision(
        TuningMove.RAISE_PREFETCH,
        deeper,
        f"the training loop waited {wait:.0%} of its time while the workers sat idle "
        f"{idle:.0%} of it, waiting for room",
    )


def _keep(prefetch: int, why: str) -> PrefetchDecision:
    return PrefetchDecision(TuningMove.HOLD, prefetch, why)
