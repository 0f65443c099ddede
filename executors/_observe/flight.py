"""The flight recorder: a driver's last scheduler events, written out when something breaks.

Every driver keeps the events its scheduler was told of in a bounded ring (`FlightRecorder.wrap`
wraps the driver's step function, whatever it is: the core's, a tracer's, a model's). When the
driver meets an internal error, an executor reporting the impossible or a timeout, it writes
them to a JSON file and names the file in the error (`FlightRecorder.attach`);
`python -m statecore replay FILE` (statecore.tools.replay) drives `step` through them again,
checks every invariant after every step and prints the trace. Since `step` is pure, the
events and the state they started from are the whole story: a failure seen once becomes a
case anyone can run.

What the ring holds, and why it is cheap:

- No batch, ever. A batch can be tens of megabytes, and a ring of a thousand events holding
  `TaskCompleted.payload` would keep a thousand of them alive. An answer is recorded as
  (task, worker), an error as its type and message (`Opaque`), marks and timings not at all
  (the scheduler passes them by, as it does payloads), and the scheduler's state, which
  holds answers in its window, only as a stripped copy (`strip_state`): every payload
  replaced by None. The core treats payloads as opaque, so a replay with the placeholders
  takes the same transitions.
- The common events (`NextRequested`, `IndexDrawn`, `TaskCompleted`) each have their hook at
  the seam, which picks it by the event's type (`seam.Routes`), and cost an append; the rest
  are rare and share the slow path. A drawn index is kept as it is
  (an int, for a loader without batching) and turned into text only when the file is written,
  as `repr` on every draw would cost more than the rest together; of a batch sampler's list
  only the first and last index and the length are kept.
- The replay must start from a state, so the ring holds a stripped copy of the state now and
  then, `Keyframe`: before every `every`-th task's answer (`every` grows with the window,
  so the copying stays a small share) and at every epoch's start. The ring holds at least
  eight such intervals' worth of events; the file starts at the oldest keyframe left in
  it, and the later keyframes tell the replay whether it still follows the live run.
- The commands are not recorded: they follow from the state and the event. The file gets
  them by replaying the ring when it is written, in the process that ran the loader, and a
  later replay (maybe of another statecore version) compares its own with them.

The file's format and the replay are `statecore.executors._observe.flightfile`, which this
module imports and which imports nothing of it. `docs/flight-recorder.md` has the file
format and the measured cost.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable

import attrs

from statecore import (
    Config,
    Event,
    ExecutorError,
    ExecutorFailed,
    ExecutorFailure,
    Failed,
    IndexDrawn,
    InternalError,
    NextRequested,
    Pending,
    Ready,
    ResetRequested,
    SamplerFailed,
    SamplerFailure,
    Slot,
    State,
    StatecoreError,
    TaskCompleted,
    TaskFailed,
    TaskFailure,
    Transition,
)
from statecore.executors._observe.flightfile import (
    Opaque,
    Raised,
    Recorded,
    Recording,
    Replayed,
    describe,
    replay,
    shortened,
    to_json,
)
from statecore.executors._observe.seam import Observer, StepFunction, observed

__all__ = [
    "DIR_VARIABLE",
    "INTERVALS",
    "MAX_FILES",
    "MIN_EVERY",
    "WINDOWS_EVERY",
    "Keyframe",
    "FlightRecorder",
    "intervals",
    "strip_state",
]

DIR_VARIABLE = "STATECORE_FLIGHT_DIR"
"""Where the files go; the system's temporary folder if unset."""
MAX_FILES = 16
"""Files one process writes at most: a program that retries a failing loader in a loop must not
fill the disk. Later errors say that nothing was written, and why."""

MIN_EVERY = 128
"""Tasks between two keyframes, at least; more with a larger window (see `intervals`)."""
WINDOWS_EVERY = 16
"""Tasks between two keyframes, in windows (workers x prefetch), at least."""
INTERVALS = 8
"""The ring's size, in keyframe intervals of three events a task (a draw, an answer, a
request): the file (from the oldest keyframe left) holds at least five intervals' events."""


def intervals(config: Config) -> tuple[int, int]:
    """(tasks between keyframes, events the ring holds) for a scheduler of `config`.

    A keyframe copies the window, up to workers x prefetch slots: one every `WINDOWS_EVERY`
    windows' worth of tasks costs a small share of a slot's copy per task, whatever the size.
    """
    every = max(MIN_EVERY, WINDOWS_EVERY * config.num_workers * config.prefetch_factor)
    return every, 3 * INTERVALS * every


# --- what the ring holds instead of payloads -----------------------------------------------


@attrs.frozen
class Keyframe:
    """A stripped copy of the live state, from before the event recorded next."""

    state: State


def _opaque(value: object) -> Opaque | None:
    return None if value is None else Opaque(describe(value))


def strip_state(state: State) -> State:
    """`state` without a payload: answers in the window and recorded errors become placeholders.

    Equal to `state` (payloads take no part in equality), and holds nothing of the data.
    """
    window = state.window
    # A pending slot keeps its index only where restarts are on (to send it again), and an
    # index may be anything a sampler yields: kept as its repr, as a drawn index is written.
    indexed = state.config.restarts and any(
        type(slot) is Pending and slot.index is not None for slot in window
    )
    if indexed or any(type(slot) is Ready or type(slot) is Failed for slot in window):
        window = tuple(_strip_slot(slot) for slot in window)
    life = state.life
    failure = life.failure
    if type(failure) is TaskFailure:
        life = attrs.evolve(life, failure=attrs.evolve(failure, error=_opaque(failure.error)))
    elif type(failure) is SamplerFailure or type(failure) is ExecutorFailure:
        life = attrs.evolve(life, failure=type(failure)(_opaque(failure.error)))
    return state._replace(window=window, life=life)


_READY = tuple(Ready(worker) for worker in range(256))
"""Stripped answers, made once: a keyframe then copies no slot (values, so sharing is safe)."""


def _strip_slot(slot: Slot) -> Slot:
    if type(slot) is Ready:
        return _READY[slot.worker] if slot.worker < len(_READY) else Ready(slot.worker)
    if type(slot) is Failed:
        return Failed(slot.worker, _opaque(slot.error))
    if type(slot) is Pending and slot.index is not None and type(slot.index) is not str:
        return Pending(slot.worker, shortened(repr(slot.index)))
    return slot


def _stripped(event: Event) -> Event:
    """A rare event without what it carries of the world (errors, marks, timings)."""
    kind = type(event)
    if kind is TaskFailed:
        task, worker = event.task, event.worker  # type: ignore[attr-defined]
        incarnation = event.incarnation  # type: ignore[attr-defined]
        return TaskFailed(task, worker, _opaque(event.error), incarnation=incarnation)  # type: ignore[attr-defined]
    if kind is SamplerFailed or kind is ExecutorFailed:
        return kind(_opaque(event.error))  # type: ignore[attr-defined]
    return event


# --- the recorder ----------------------------------------------------------------------------

_files_written = 0
_files_lock = threading.Lock()


class FlightRecorder:
    """The ring of one driver's last events; see the module's docstring."""

    def __init__(self, config: Config) -> None:
        self.every, self.size = intervals(config)
        self.ring: deque[object] = deque(maxlen=self.size)
        """Events (the common ones as they are, an answer as (task, worker), a batch sampler's
        draw as (first index, last index, length)), each
        `Keyframe` before the event it precedes, each `Raised` after the event it follows.

        The first keyframe comes with the first `ResetRequested`, which is a loader's first
        event, not with `state`: the models give a driver the state of their world after
        building it, and the file of such a driver would start from the wrong one."""
        self.notes: dict[object, str] = {}
        """What was said of an error already written out, by the key the caller gave."""

    def observer(self) -> Observer:
        """The recorder's hooks at a driver's seam (`observed`): every event the driver's
        `step` is told of is recorded; an error of the core's or the executor's that `step`
        raises, and one the driver raises, names the file written."""
        record = self.ring.append
        every = self.every
        rare = self._rare

        # Run on every step of every loader, one per event type (the seam picks): the common
        # events have their own, which do nothing more than record them.
        def requested(state: State, event: Event, _: Transition | None = None) -> None:
            record(event)

        def drawn(state: State, event: Event, _: Transition | None = None) -> None:
            index = event.index  # type: ignore[attr-defined]
            if type(index) is list and index:
                # A batch sampler's list: a thousand of them, of a thousand indices each,
                # would be tens of megabytes, so only its ends and its length are kept.
                record((index[0], index[-1], len(index)))
            else:
                record(event)

        def completed(state: State, event: Event, _: Transition | None = None) -> None:
            task = event.task  # type: ignore[attr-defined]
            if not task % every:
                record(Keyframe(strip_state(state)))
            incarnation = event.incarnation  # type: ignore[attr-defined]
            if incarnation:  # a replaced worker's: the replay must tell it from the lost one's
                record(TaskCompleted(task, event.worker, incarnation=incarnation))  # type: ignore[attr-defined]
            else:
                record((task, event.worker))  # type: ignore[attr-defined]

        hooks: dict[type[Event], Callable[[State, Event, Transition | None], None]] = {
            NextRequested: requested,
            IndexDrawn: drawn,
            TaskCompleted: completed,
        }

        def refused(state: State, event: Event, error: BaseException) -> None:
            hooks.get(type(event), rare)(state, event, None)
            self._raised(state, error)

        return Observer(rare, refused, self.attach, self, hooks)

    def wrap(self, step: StepFunction) -> StepFunction:
        """`step`, recording every event it is given, through the seam as a driver's is."""
        return observed(step, [self.observer()])

    def _rare(self, state: State, event: Event, _: Transition | None = None) -> None:
        """The events other than a request, a draw and a task's batch: an epoch's start, a
        failure, a worker's news..."""
        kind = type(event)
        ring = self.ring
        # An answer counts as TaskCompleted's do; an epoch's start is where a replay may well begin.
        task = event.task if kind is TaskFailed else None  # type: ignore[attr-defined]
        due = kind is ResetRequested or (task is not None and not task % self.every)
        if due and not (ring and type(ring[-1]) is Keyframe):
            ring.append(Keyframe(strip_state(state)))
        ring.append(_stripped(event))

    def _raised(self, state: State, error: BaseException) -> None:
        self.ring.append(
            Raised(type(error).__name__, describe(error), isinstance(error, StatecoreError))
        )
        # The core refusing an executor's event, or failing itself, is a bug worth a file; a
        # consumer's misuse is the consumer's, and says so already.
        if isinstance(error, (InternalError, ExecutorError)):
            self.attach(error, state)

    def events(self) -> int:
        """Events held now."""
        return sum(1 for record in self.ring if type(record) not in (Keyframe, Raised))

    def attach(
        self, error: BaseException, state: State, key: object = None, as_note: bool = False
    ) -> None:
        """Write the ring out and name the file at the end of `error`'s message.

        `state` is the driver's now. Never raises: a file that cannot be written is said so in
        the message instead, and the caller raises `error` as it would have. With a `key`, an
        error raised again (a failure is sticky) gets what the first was told, and no new file.
        With `as_note` the message stays as it was and the sentence is the error's note (PEP
        678), which a traceback prints under it: for torch's own errors, whose messages logs
        and alert rules match.
        """
        note = self.notes.get(key) if key is not None else None
        if note is None:
            note = self._write(state, describe(error))
            if key is not None:
                self.notes[key] = note
        if as_note:
            error.add_note(note)
        else:
            message = str(error.args[0]) if len(error.args) == 1 else str(error)
            error.args = (f"{message}\n{note}",)

    def _write(self, state: State, reason: str) -> str:
        global _files_written
        folder = os.environ.get(DIR_VARIABLE) or tempfile.gettempdir()
        events = self.events()
        if not any(type(record) is Keyframe for record in self.ring):
            return (
                f"flight recorder: the last {events} scheduler events were not written: none of "
                "them comes after a state a replay could start from"
            )
        with _files_lock:
            if _files_written >= MAX_FILES:
                return (
                    f"flight recorder: the last {events} scheduler events were not written: this "
                    f"process already wrote (or tried to write) {MAX_FILES} files, in {folder}"
                )
            _files_written += 1
        try:
            recording, replayed = self.recording(state, reason)
            found = [(done.number, found) for done in replayed for found in done.violations]
            text = to_json(recording)
            os.makedirs(folder, exist_ok=True)
            handle, path = tempfile.mkstemp(prefix="statecore-flight-", suffix=".json", dir=folder)
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(text)
        except Exception as error:  # whatever goes wrong here, the error raised is the caller's
            return (
                f"flight recorder: could not write the last {events} scheduler events to "
                f"{folder} ({describe(error)}); set {DIR_VARIABLE} to a writable folder"
            )
        note = (
            f"flight recorder: the last {len(recording.steps)} scheduler events are in {path}; "
            f"replay with `python -m statecore replay {path}`"
        )
        if found:
            number, sentence = found[0]
            at = "in the starting state" if number == 0 else f"after step {number}"
            note += (
                f". The replay finds {len(found)} broken invariant(s), the first {at}: {sentence}"
            )
        return note

    def recording(self, state: State, reason: str) -> tuple[Recording, list[Replayed]]:
        """What the file holds (the ring from its oldest keyframe, the commands replayed),
        and the replay that gave the commands. `state` is the driver's now."""
        records = list(self.ring)
        keyframes = [i for i, r in enumerate(records) if type(r) is Keyframe]
        if not keyframes:
            raise ValueError("the ring holds no state a replay could start from")
        first = keyframes[0]
        dropped = sum(1 for r in records[:first] if type(r) not in (Keyframe, Raised))
        start = records[first].state  # type: ignore[attr-defined]
        steps: list[Recorded] = []
        before: State | None = None
        for record in records[first + 1 :]:
            if type(record) is Keyframe:
                before = record.state
            elif type(record) is Raised:
                if steps:  # the event it follows fell off the ring with its keyframe
                    steps[-1] = attrs.evolve(steps[-1], raised=record)
            else:
                steps.append(Recorded(_event_of(record), before=before))
                before = None
        recording = Recording(
            reason=reason,
            written=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            pid=os.getpid(),
            version=_version(),
            dropped=dropped,
            start=start,
            steps=tuple(steps),
            end=strip_state(state),
        )
        # The commands follow from the events: replayed here, with the code that ran them.
        done = list(replay(recording))
        commands = {replayed.number: replayed.commands for replayed in done}
        replayed = tuple(
            attrs.evolve(recorded, commands=commands[number])
            for number, recorded in enumerate(recording.steps, 1)
        )
        return attrs.evolve(recording, steps=replayed), done


def _event_of(record: object) -> Event:
    """The event a ring record stands for, payload-free."""
    if type(record) is tuple and len(record) == 2:
        task, worker = record
        return TaskCompleted(task, worker)
    if type(record) is tuple:
        first, last, length = record
        shown = [first, last] if length == 2 else [first] if length == 1 else None
        if shown is None:
            return IndexDrawn(shortened(f"[{first!r}, ..., {last!r}] ({length} indices)"))
        return IndexDrawn(shortened(repr(shown)))
    if type(record) is IndexDrawn:
        return IndexDrawn(shortened(repr(record.index)))
    return record  # type: ignore[return-value]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("statecore")
    except Exception:
        return "unknown"
