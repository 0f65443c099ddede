"""The flight recorder's file: its format (`to_json`, `from_json`, `encode`, `decode`), the
values it holds in place of what the scheduler treats as opaque (`Opaque`, `Raised`), and the
replay of a recording through `step` (`replay`), which checks every invariant after every step
and says where it leaves the live run. docs/flight-recorder.md describes the format.

Readers only: nothing here records, and nothing here imports the recorder
(`statecore.executors._observe.flight`), which imports this.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import types
import typing
from collections.abc import Iterator
from typing import Any

import attrs

import statecore
from statecore import (
    RESOLVED,
    Command,
    Event,
    Resolved,
    State,
    StatecoreError,
    step,
    violations,
)
from statecore.executors._observe.seam import StepFunction
from statecore.executors._remote import RemoteError

__all__ = [
    "FORMAT",
    "MAX_WORKERS",
    "TEXT_LIMIT",
    "VERSION",
    "FlightFileError",
    "Opaque",
    "Raised",
    "Recorded",
    "Recording",
    "Replayed",
    "decode",
    "describe",
    "encode",
    "from_json",
    "replay",
    "shortened",
    "to_json",
]

FORMAT = "statecore-flight"
VERSION = 1
TEXT_LIMIT = 200
"""Characters kept of an index's repr, or of an error's message."""


@attrs.frozen
class Opaque:
    """What the recorder kept of an error, which the scheduler treats as opaque: its type and
    message. It stands in for the error when the events are replayed."""

    text: str


@attrs.frozen
class Raised:
    """The step of the event recorded just before raised this, so the driver kept its state.

    `core` says `step` itself refused the event (a `StatecoreError`), which a replay must see
    again; otherwise something around it raised (an interrupt arriving, a wrapper's check)."""

    kind: str
    message: str
    core: bool


def describe(value: object) -> str:
    """An error (or any value) in one line: its type and message, cut to `TEXT_LIMIT`."""
    try:
        if isinstance(value, BaseException):
            text = f"{type(value).__name__}: {value}"
        elif isinstance(value, RemoteError):  # a worker's error, carried as data
            text = f"{value.type_name}: {value.message}"
        else:
            text = repr(value)
    except Exception as error:  # a value that cannot say what it is must not break a dump
        text = f"<{type(value).__name__} that cannot be printed: {type(error).__name__}>"
    return shortened(" / ".join(line for line in text.splitlines() if line.strip()))


def shortened(text: str) -> str:
    return text if len(text) <= TEXT_LIMIT else text[: TEXT_LIMIT - 3] + "..."


# --- recordings and their replay -----------------------------------------------------------


@attrs.frozen
class Recorded:
    """One event as the live run saw it."""

    event: Event
    before: State | None = None
    """The live state before it, where the recorder took a keyframe."""
    raised: Raised | None = None
    """What its step raised: the driver then kept the state it had."""
    commands: tuple[Command, ...] | None = None
    """What `step` answered, replayed when the file was written; None before that."""


@attrs.frozen
class Recording:
    """What a flight recorder file holds."""

    reason: str
    """The error that had the file written, in a line."""
    written: str
    pid: int
    version: str
    """statecore's version that wrote it."""
    dropped: int
    """Events older than the oldest keyframe the ring held: left out, as nothing replays them."""
    start: State
    steps: tuple[Recorded, ...]
    end: State
    """The live state when the file was written."""


@attrs.frozen
class Replayed:
    """What replaying one recorded event gave."""

    number: int
    """1 for the first event of the file; 0 for the start, one past the last for the end."""
    recorded: Recorded | None
    """None for the start and the end, which have no event."""
    commands: tuple[Command, ...]
    raised: str | None
    """What `step` raised in the replay, in a line."""
    violations: tuple[str, ...]
    divergence: tuple[str, ...]
    """How the replay differs from the live run, in sentences; empty if it follows it."""


def replay(recording: Recording, run: StepFunction = step) -> Iterator[Replayed]:
    """Drive `run` through the recorded events from the recorded start, checking as it goes.

    Where the replay leaves the live run (a keyframe, the commands or a raise differ) it
    says so and goes on from the live run's state where that is known, so one divergence does
    not hide the rest. The start's violations come first, as a step numbered 0 with no event.
    """
    state = recording.start
    found = _violations(state)
    if found:
        yield Replayed(0, None, (), None, found, ())
    for number, recorded in enumerate(recording.steps, 1):
        divergence: list[str] = []
        if recorded.before is not None and recorded.before != state:
            divergence.append(
                "the state before it is not the live run's: " + _differences(state, recorded.before)
            )
            state = recorded.before
        raised: str | None = None
        commands: tuple[Command, ...] = ()
        after = state
        crashed: tuple[str, ...] = ()
        try:
            after, commands = run(state, recorded.event)
        except StatecoreError as error:
            raised = f"{type(error).__name__}: {error}"
        except Exception as error:
            # Not a refusal of the core's but its failure: a state no run of the core gives
            # (a file edited by hand) may do that, and the replay says so instead of dying.
            raised = describe(error)
            crashed = (f"step failed on this state and event with {raised}",)
        live = recorded.raised
        if live is not None and live.core:
            if raised is None:
                divergence.append(f"the live run's step raised {live.kind}: {live.message}")
            elif not raised.startswith(f"{live.kind}:"):
                divergence.append(f"the live run's step raised {live.kind} instead")
        elif raised is not None and live is None:
            divergence.append("the live run's step did not raise")
        if recorded.commands is not None and recorded.commands != commands:
            divergence.append(
                "the live run's commands were "
                + (", ".join(map(repr, recorded.commands)) or "none")
            )
        found = crashed if raised is not None else _violations(after)
        if live is None and raised is None:
            state = after  # else the driver kept the state it had
        yield Replayed(number, recorded, commands, raised, found, tuple(divergence))
    if recording.end != state:
        differences = _differences(state, recording.end)
        yield Replayed(
            len(recording.steps) + 1,
            None,
            (),
            None,
            (),
            (f"the state it ends in is not the live run's: {differences}",),
        )


def _violations(state: State) -> tuple[str, ...]:
    """The invariants `state` breaks, or, where checking them fails, that failure."""
    try:
        return tuple(violations(state))
    except Exception as error:  # a hand-edited state the checks cannot read
        return (f"the invariants cannot be checked on this state: {describe(error)}",)


def _differences(replayed: State, live: State) -> str:
    """Which fields differ, with both values: replayed first."""
    parts = []
    for name in State._fields:
        ours, theirs = getattr(replayed, name), getattr(live, name)
        if ours == theirs:
            continue
        if attrs.has(type(ours)) and type(ours) is type(theirs):
            for field in attrs.fields(type(ours)):
                if not field.init:
                    continue  # derived from the others (`Lifecycle.retiring`): they differ too
                mine, other = getattr(ours, field.name), getattr(theirs, field.name)
                if mine != other:
                    parts.append(f"{name}.{field.name} {mine!r} (live {other!r})")
        else:
            parts.append(f"{name} {ours!r} (live {theirs!r})")
    return "; ".join(parts)


# --- the file ----------------------------------------------------------------------------------


class FlightFileError(ValueError):
    """A file that is not a flight recording this version of statecore can read."""


def _classes() -> dict[str, type]:
    found: dict[str, type] = {
        name: value
        for name in statecore.__all__
        if isinstance(value := getattr(statecore, name), type) and attrs.has(value)
    }
    found["Opaque"] = Opaque
    found["Raised"] = Raised
    return found


_CLASSES = _classes()
_ENUMS = {"Phase": statecore.Phase, "WorkerStatus": statecore.WorkerStatus}


def encode(value: object) -> Any:
    """`value` (a state, an event, a command or a part of one) as JSON-ready data.

    A payload cannot be encoded: strip it first (`strip_state`). Fields at their default are
    left out; `decode` gives them back.
    """
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is tuple:
        return [encode(item) for item in value]
    if type(value) is frozenset:
        items = [encode(item) for item in value]
        return {"frozenset": sorted(items, key=json.dumps)}
    if isinstance(value, enum.Enum) and type(value).__name__ in _ENUMS:
        return {"enum": type(value).__name__, "name": value.name}
    if type(value) is State:
        fields = {name: encode(getattr(value, name)) for name in State._fields}
        return {"type": "State", **fields}
    name = type(value).__name__
    if _CLASSES.get(name) is type(value):
        encoded: dict[str, Any] = {"type": name}
        for field in attrs.fields(type(value)):  # type: ignore[arg-type]
            if not field.init:
                continue  # derived as the value is built (`Lifecycle.retiring`): not written
            item = getattr(value, field.name)
            if field.default is not attrs.NOTHING and item is field.default:
                continue
            encoded[field.name] = encode(item)
        return encoded
    raise TypeError(f"the flight recorder cannot encode {type(value).__name__} {value!r}")


def decode(data: Any) -> Any:
    """The state, event, command or other value of the core that `encode` gave `data` for,
    every field checked as `from_json` checks a file's. Raises FlightFileError otherwise."""
    name = data.get("type") if type(data) is dict else None
    kind = State if name == "State" else _CLASSES.get(name) if type(name) is str else None
    if kind is None:
        raise FlightFileError(
            _wrong("value", data, 'an object whose "type" names a class of the core')
        )
    return _read(data, kind, "value")


def to_json(recording: Recording) -> str:
    """The file's text: the header's fields, then one line per event."""
    header = {
        "format": FORMAT,
        "version": VERSION,
        "reason": recording.reason,
        "written": recording.written,
        "pid": recording.pid,
        "statecore": recording.version,
        "dropped": recording.dropped,
        "start": encode(recording.start),
    }
    lines = ["{"] + [f" {json.dumps(key)}: {json.dumps(value)}," for key, value in header.items()]
    lines.append(' "steps": [')
    steps = [json.dumps(_step_data(recorded)) for recorded in recording.steps]
    lines.append(",\n".join(f"  {text}" for text in steps))
    lines.append(" ],")
    lines.append(f' "end": {json.dumps(encode(recording.end))}')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _step_data(recorded: Recorded) -> dict[str, Any]:
    data: dict[str, Any] = {"event": encode(recorded.event)}
    if recorded.commands is not None:
        data["commands"] = encode(recorded.commands)
    if recorded.raised is not None:
        data["raised"] = encode(recorded.raised)
    if recorded.before is not None:
        data["before"] = encode(recorded.before)
    return data


def from_json(text: str) -> Recording:
    """The recording in a file's text. Raises FlightFileError, in one line naming the field,
    what it holds and what was expected, if it is not one.

    Every field is checked for its type and range as it is read, so that the replay meets
    nothing the core could not have produced: the file is data, never code (nothing in it is
    executed, imported or unpickled; only the classes of the core's own values are built).
    """
    try:
        data = json.loads(text)
    except RecursionError:
        raise FlightFileError("not a flight recording: its JSON is nested too deeply") from None
    except ValueError as error:
        raise FlightFileError(f"not JSON: {error}") from None
    if type(data) is not dict or data.get("format") != FORMAT:
        raise FlightFileError(f'not a flight recording (no "format": "{FORMAT}")')
    version = data.get("version")
    if type(version) is not int or version != VERSION:
        raise FlightFileError(
            f"a flight recording of version {_shown(version)}; this statecore reads "
            f"version {VERSION}: replay it with the statecore version that wrote it "
            f"({_shown(data.get('statecore', 'unknown'))})"
        )
    for key in _HEADER:
        if key not in data:
            raise FlightFileError(f'the field "{key}" is missing')
    unknown = sorted(set(data) - set(_HEADER) - {"format", "version"})
    if unknown:
        raise FlightFileError(
            f"unknown field {_shown(unknown[0])} (the fields are {', '.join(_HEADER)})"
        )
    steps = data["steps"]
    if type(steps) is not list:
        raise FlightFileError(_wrong("steps", steps, "a list of recorded steps"))
    return Recording(
        reason=_read(data["reason"], str, "reason"),
        written=_read(data["written"], str, "written"),
        pid=_read(data["pid"], int, "pid"),
        version=_read(data["statecore"], str, "statecore"),
        dropped=_read(data["dropped"], int, "dropped"),
        start=_state(data["start"], "start"),
        steps=tuple(_recorded(item, f"steps[{i}]") for i, item in enumerate(steps)),
        end=_state(data["end"], "end"),
    )


_HEADER = ("reason", "written", "pid", "statecore", "dropped", "start", "steps", "end")

MAX_WORKERS = 1 << 16
"""Workers a recorded scheduler may have: a replay builds per-worker tuples, so a file saying
`num_workers: 10**8` must be refused, not obeyed."""

_SIGNED = frozenset({"seed", "exitcode"})
"""Integer fields that may be negative (a seed; an exit code, negative for a signal); every
other integer of the core counts something or numbers a task or a worker."""

_OBJECTS: dict[str, Any] = {"error": Opaque | None, "index": str}
"""What a file holds for the fields the core treats as opaque: an error as its text, an index
as its repr (`_event_of`); the rest (payloads, marks, timings) are never written."""

_STEP_KEYS = ("event", "commands", "raised", "before")


def _recorded(data: object, where: str) -> Recorded:
    if type(data) is not dict:
        raise FlightFileError(_wrong(where, data, "an object with an event"))
    _known_keys(data, _STEP_KEYS, where)
    if "event" not in data:
        raise FlightFileError(f'"{where}.event" is missing')
    return Recorded(
        event=_read(data["event"], Event, f"{where}.event"),
        before=_state(data["before"], f"{where}.before") if "before" in data else None,
        raised=_read(data["raised"], Raised, f"{where}.raised") if "raised" in data else None,
        commands=(
            _read(data["commands"], tuple[Command, ...], f"{where}.commands")
            if "commands" in data
            else None
        ),
    )


def _state(data: object, where: str) -> State:
    """A recorded state, its per-worker parts checked against its own worker count, as the
    core (and its invariants) index them by worker."""
    state: State = _read(data, State, where)
    workers = state.config.num_workers
    if workers > MAX_WORKERS:
        raise FlightFileError(
            _wrong(f"{where}.config.num_workers", workers, f"at most {MAX_WORKERS} workers")
        )
    per_worker = (
        ("life.workers", state.life.workers),
        ("life.incarnations", state.life.incarnations),
        ("loads", state.loads),
    )
    for field, value in per_worker:
        if len(value) != workers:
            raise FlightFileError(
                f'"{where}.{field}" holds {len(value)} entries; expected one per worker, '
                f"{workers} (config.num_workers)"
            )
    owners = [
        (f"window[{i}]", slot.worker)
        for i, slot in enumerate(state.window)
        if not isinstance(slot, Resolved)
    ]
    owners += [("life.stale", worker) for _, worker in state.life.stale]
    for field, worker in owners:
        if worker >= workers:
            raise FlightFileError(
                f'"{where}.{field}" names worker {worker}; expected a worker below {workers} '
                "(config.num_workers)"
            )
    return state


def _read(data: object, hint: Any, where: str) -> Any:
    """`data` read as a value of the type `hint` (a field's annotation), or FlightFileError
    naming `where`, what it holds and what was expected."""
    if hint is int or hint is float:
        kinds = (int,) if hint is int else (int, float)
        signed = where.rsplit(".", 1)[-1] in _SIGNED
        if type(data) not in kinds or (hint is float and not math.isfinite(data)):  # type: ignore[arg-type]
            raise FlightFileError(_wrong(where, data, _words(hint, signed)))
        if not signed and data < 0:  # type: ignore[operator]
            raise FlightFileError(_wrong(where, data, _words(hint, signed)))
        return data
    if hint is str or hint is bool or hint is type(None):
        if type(data) is not hint:
            raise FlightFileError(_wrong(where, data, _words(hint)))
        if hint is str:
            try:
                data.encode("utf-8")  # type: ignore[union-attr]
            except UnicodeEncodeError:
                # A lone surrogate (JSON's "\ud800"), which no output can print: kept escaped,
                # the same way wherever it occurs, so that equal texts stay equal.
                return data.encode("utf-8", "backslashreplace").decode("utf-8")  # type: ignore[union-attr]
        return data
    origin = typing.get_origin(hint)
    if origin is types.UnionType or origin is typing.Union:
        options = typing.get_args(hint)
        if data is None and type(None) in options:
            return None
        classes = [option for option in options if option is not type(None)]
        if len(classes) == 1:
            return _read(data, classes[0], where)
        return _instance(data, classes, where, hint)
    if origin is tuple:
        items = typing.get_args(hint)
        if type(data) is not list:
            raise FlightFileError(_wrong(where, data, _words(hint)))
        if items[-1] is Ellipsis:
            return tuple(_read(item, items[0], f"{where}[{i}]") for i, item in enumerate(data))
        if len(data) != len(items):
            raise FlightFileError(_wrong(where, data, _words(hint)))
        return tuple(
            _read(item, kind, f"{where}[{i}]")
            for i, (item, kind) in enumerate(zip(data, items, strict=True))
        )
    if origin is frozenset:
        (item_hint,) = typing.get_args(hint)
        if (
            type(data) is not dict
            or set(data) != {"frozenset"}
            or type(data["frozenset"]) is not list
        ):
            raise FlightFileError(_wrong(where, data, _words(hint)))
        members = data["frozenset"]
        return frozenset(_read(item, item_hint, f"{where}[{i}]") for i, item in enumerate(members))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        name = (
            data.get("name") if type(data) is dict and data.get("enum") == hint.__name__ else None
        )
        if (
            type(data) is not dict
            or set(data) != {"enum", "name"}
            or type(name) is not str
            or name not in hint.__members__
        ):
            raise FlightFileError(_wrong(where, data, _words(hint)))
        return hint[name]
    if hint is Event or hint is Command:
        return _instance(data, [c for c in _CLASSES.values() if issubclass(c, hint)], where, hint)
    if hint is State or (isinstance(hint, type) and attrs.has(hint)):
        return _instance(data, [hint], where, hint)
    raise TypeError(f"the flight file's reader has no rule for {hint!r}")  # a bug of ours


def _instance(data: object, classes: list[type], where: str, hint: Any) -> Any:
    """An object of one of `classes` (attrs classes, or State), named by its "type"."""
    names = {cls.__name__: cls for cls in classes}
    name = data.get("type") if type(data) is dict else None
    if type(name) is not str or name not in names:
        raise FlightFileError(_wrong(where, data, _words(hint)))
    cls = names[name]
    assert type(data) is dict
    hints = _hints(cls)
    _known_keys(data, ("type", *hints), where)
    if cls is Resolved:
        return RESOLVED  # the core tells a resolved slot by identity
    fields = {}
    for field, field_hint in hints.items():
        if field in data:
            if field_hint is object:
                field_hint = _OBJECTS.get(field, type(None))
            fields[field] = _read(data[field], field_hint, f"{where}.{field}")
        elif field not in _defaults(cls):
            raise FlightFileError(f'"{where}.{field}" is missing ({name} has no default for it)')
    try:
        return cls(**fields)
    except ValueError as error:  # a class's own check (a Config's counts, a Progress's positions)
        raise FlightFileError(f'"{where}" ({name}) is refused: {describe(error)}') from None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The fields of one of the core's classes that its constructor takes, with their declared
    types: read once. A field derived as the value is built (`Lifecycle.retiring`) is not one."""
    hints = typing.get_type_hints(cls)
    if attrs.has(cls):
        taken = {field.name for field in attrs.fields(cls) if field.init}
        hints = {name: hint for name, hint in hints.items() if name in taken}
    return hints


@functools.cache
def _defaults(cls: type) -> frozenset[str]:
    """The fields of `cls` that have a default, which `encode` leaves out when at it."""
    if cls is State:
        return frozenset()
    return frozenset(f.name for f in attrs.fields(cls) if f.default is not attrs.NOTHING)


def _known_keys(data: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(data) - set(keys), key=str)
    if unknown:
        known = ", ".join(key for key in keys if key != "type")
        raise FlightFileError(
            f'"{where}" holds an unknown field {_shown(unknown[0])} (known: {known})'
        )


def _shown(data: object) -> str:
    """A JSON value as the file holds it, cut short."""
    try:
        text = json.dumps(data)
    except RecursionError:  # read at the parser's limit, written from a deeper stack
        return "a value nested too deeply to show"
    return text if len(text) <= 60 else text[:57] + "..."


def _wrong(where: str, data: object, expected: str) -> str:
    return f'"{where}" holds {_shown(data)}; expected {expected}'


def _words(hint: Any, signed: bool = False) -> str:
    """What a file must hold for `hint`, in words."""
    if hint is int:
        return "an integer" if signed else "an integer of at least 0"
    if hint is float:
        return "a finite number" if signed else "a finite number of at least 0"
    if hint is str:
        return "a string"
    if hint is bool:
        return "true or false"
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint)
    if origin is types.UnionType or origin is typing.Union:
        options = typing.get_args(hint)
        classes = [f'"{o.__name__}"' for o in options if attrs.has(o)]
        rest = [_words(o) for o in options if not attrs.has(o)]
        if len(classes) > 1:
            rest.insert(0, f'an object whose "type" is {", ".join(classes[:-1])} or {classes[-1]}')
        else:
            rest = [_words(option) for option in options]
        return " or ".join(rest)
    if origin is tuple:
        items = typing.get_args(hint)
        if items[-1] is Ellipsis:
            return f"a list, each item {_words(items[0])}"
        return f"a list of {len(items)}: " + ", ".join(_words(item) for item in items)
    if origin is frozenset:
        return f'{{"frozenset": [...]}}, each item {_words(typing.get_args(hint)[0])}'
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        members = "|".join(hint.__members__)
        return f'{{"enum": "{hint.__name__}", "name": "{members}"}}'
    if hint is Event or hint is Command:
        return f'an object whose "type" names {"an event" if hint is Event else "a command"}'
    return f'an object whose "type" is "{hint.__name__}"'
