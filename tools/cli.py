"""The command line: `python -m statecore check | diagram | demo | bench | profile | replay`."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs

from statecore import Config
from statecore.models.explorer import Bounds, default_scenarios, explore_all
from statecore.models.world import Scenario
from statecore.tools.progress import Bar

__all__ = ["main", "scenario_label"]


def _config_label(config: Config) -> str:
    """Every field of `config`, in words: no two configurations share a label."""
    kind = "iterable" if config.iterable else "map"
    order = "in-order" if config.in_order else "any-order"
    persistent = "persistent" if config.persistent_workers else "one-epoch"
    # lazy: the sampler is read only when the consumer waits, as by a loader without workers
    sampler = "sampler=on-demand" if config.lazy else "sampler=ahead"
    # Slots that begin retired, named only where some do: the other labels stay as they were.
    started = "" if config.started is None else f" started={config.started}"
    return (
        f"workers={config.num_workers} prefetch={config.prefetch_factor} "
        f"{kind:8} {order:9} {persistent:10} {sampler:17} restarts={config.restarts}{started}"
    )


def _words(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, tuple):
        return ":".join(_words(item) for item in value) if value else "-"
    if isinstance(value, frozenset):
        return ",".join(sorted(_words(item) for item in value)) if value else "-"
    return str(value)


def _fields(value: attrs.AttrsInstance, skip: tuple[str, ...] = ()) -> str:
    # Every field, named: a field added later shows up without touching this function.
    return " ".join(
        f"{field.name}={_words(getattr(value, field.name))}"
        for field in attrs.fields(type(value))
        if field.name not in skip
    )


def scenario_label(scenario: Scenario) -> str:
    """Every field of `scenario`, its config and dataset included: no two share a label."""
    return (
        f"{_config_label(scenario.config)} {_fields(scenario.dataset):24} "
        f"{_fields(scenario, skip=('config', 'dataset'))}"
    )


def check(processes: int, bench: bool, verbose: bool, progress_bar: bool = True) -> int:
    """Explore every default scenario; print what was covered and any violation.

    While exploring, a bar over the configurations is drawn on stderr if it is a terminal and
    `progress_bar` is true (`statecore.tools.progress`); nothing is printed there otherwise.
    """
    scenarios = list(default_scenarios(Bounds()))
    print(
        f"exploring {len(scenarios)} configurations exhaustively "
        f"(workers 1-3, prefetch 1-2, up to {Bounds().batches} batches, map and iterable, "
        "in order and not, persistent and not, the sampler read ahead and on demand; with worker "
        "deaths, timeouts, closes and an interrupted wait; and workers that come and go: dead or "
        "stuck, replaced while 0-2 restarts last, late answers of the lost, retired and added "
        "back by a tuner) ...",
        flush=True,
    )
    started = time.perf_counter()
    with Bar(len(scenarios), unit="config", description="check", show=progress_bar) as bar:
        reports = explore_all(scenarios, processes=processes, on_progress=lambda _: bar.advance())
    elapsed = time.perf_counter() - started
    if verbose:
        labels = [scenario_label(report.scenario) for report in reports]
        width = max([len("configuration"), *map(len, labels)])
        print(f"  {'configuration':{width}} {'worlds':>8} {'states':>7} {'transitions':>11}")
        for label, report in zip(labels, reports, strict=True):
            print(
                f"  {label:{width}} {report.worlds:8d} {len(report.states):7d} "
                f"{report.transitions:11d}"
            )
    worlds = sum(report.worlds for report in reports)
    transitions = sum(report.transitions for report in reports)
    states = len(frozenset().union(*(report.states for report in reports)))
    failures = [report for report in reports if not report.ok]
    print(f"configurations:      {len(reports)}")
    print(f"distinct states:     {states}  (scheduler states; {worlds} worlds with environment)")
    print(f"transitions:         {transitions}")
    print(f"violations:          {len(failures)}")
    print(f"time:                {elapsed:.1f} s on {processes} process(es)")
    for report in failures:
        print()
        print(report.describe())
    if bench:
        from statecore.tools.step_bench import run_bench

        print()
        print(run_bench().describe())
    return 1 if failures else 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _add_no_progress(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="draw no progress bar, even on a terminal (none is drawn when stderr is not one, "
        "nor under CI=true or TERM=dumb)",
    )


def _add_bench(commands: Any) -> None:
    bench_parser = commands.add_parser(
        "bench",
        help="time torch's DataLoader and statecore's (default executor and threads) on the "
        "same workloads, taking turns, and print the medians, ratios and peak memory",
    )
    bench_parser.add_argument(
        "--quick", action="store_true", help="smaller epochs and fewer rounds: a few minutes"
    )
    bench_parser.add_argument(
        "--only", type=_names, metavar="NAME[,NAME]", help="run only these workloads"
    )
    bench_parser.add_argument(
        "--rounds",
        type=_positive,
        metavar="N",
        help="rounds of runs per workload, one run of each loader a round (default: 5, or 3 "
        "with --quick)",
    )
    bench_parser.add_argument(
        "--batches", type=_positive, metavar="N", help="batches per epoch, for every workload"
    )
    bench_parser.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    bench_parser.add_argument(
        "--plot", metavar="PATH", help="draw the ratios and the straggler timelines as a PNG"
    )
    bench_parser.add_argument(
        "--no-memory",
        dest="memory",
        action="store_false",
        help="skip the peak-memory runs (each a fresh interpreter per loader and workload)",
    )
    bench_parser.add_argument(
        "--ray",
        action="store_true",
        help='also time statecore with executor="ray" on the workloads with workers (a local '
        "Ray instance unless RAY_ADDRESS names a cluster; needs the ray extra)",
    )
    bench_parser.add_argument(
        "--auto",
        action="store_true",
        help='also time statecore with num_workers="auto" on the workloads with workers and a '
        "map-style dataset (an auto column)",
    )
    bench_parser.add_argument(
        "--sweep",
        action="store_true",
        help="instead of torch against statecore: statecore with num_workers in 1, 2, 4, 8, 16 "
        'and "auto", taking turns in rounds, on an I/O-bound, a CPU-bound, a mixed, a '
        "straggler and a busy-consumer workload; medians, the best count, auto's ratio to it, "
        "what auto settled on and peak memory (takes --quick, --only, --rounds, --batches, "
        "--json, --no-memory)",
    )
    bench_parser.add_argument(
        "--cache",
        metavar="DIR",
        help="where the images workload keeps its encoded images, made once (default: "
        "$STATECORE_CACHE, else ~/.cache/statecore)",
    )
    bench_parser.add_argument(
        "--breakdown",
        action="store_true",
        help="the images workload also says where each loader's CPU went: decoding, augmenting, "
        "making tensors, collating, the loader in the workers and in the main process",
    )
    bench_parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    _add_no_progress(bench_parser)


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from statecore.tools import loader_bench
    from statecore.tools.workloads import WORKLOADS

    if args.list:
        for workload in WORKLOADS:
            named = " (runs only when named: --only)" if workload.when_named else ""
            print(f"{workload.name:22} {workload.summary}{named}")
        return 0
    if args.batches is not None and args.batches < 2:
        print("bench: --batches must be at least 2", file=sys.stderr)
        return 2
    if args.sweep:
        from statecore.tools import sweep

        if args.plot is not None or args.ray or args.auto:
            print(
                "bench: --sweep runs auto against fixed counts itself, and draws no plot and "
                "runs no Ray: drop --plot, --ray and --auto",
                file=sys.stderr,
            )
            return 2
        return sweep.sweep(
            quick=args.quick,
            only=args.only,
            rounds=args.rounds,
            batches=args.batches,
            json_path=args.json,
            memory=args.memory,
            command=shlex.join(["python", "-m", "statecore", *argv]),
        )
    return loader_bench.bench(
        quick=args.quick,
        only=args.only,
        rounds=args.rounds,
        batches=args.batches,
        json_path=args.json,
        plot_path=args.plot,
        memory=args.memory,
        progress_bar=args.progress,
        ray=args.ray,
        auto=args.auto,
        cache=args.cache,
        breakdown=args.breakdown,
        command=shlex.join(["python", "-m", "statecore", *argv]),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m statecore", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check_parser = commands.add_parser(
        "check", help="explore every state of small configurations and check every invariant"
    )
    check_parser.add_argument(
        "--bench",
        action="store_true",
        help="also time `step` against torch-style bookkeeping, and at 2 to 256 workers",
    )
    check_parser.add_argument(
        "--processes",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="processes to explore in (default: up to 2)",
    )
    check_parser.add_argument(
        "-v", "--verbose", action="store_true", help="print a line per configuration"
    )
    _add_no_progress(check_parser)
    commands.add_parser("diagram", help="print the state diagram (Mermaid) from the table")
    demo_parser = commands.add_parser(
        "demo",
        help="load a synthetic image set through every executor and through torch; check that "
        "the batches match and compare the speed",
    )
    demo_parser.add_argument(
        "--quick", action="store_true", help="a small run that finishes in a few seconds"
    )
    demo_parser.add_argument(
        "--batches",
        type=int,
        default=None,
        metavar="N",
        help="batches per epoch (default: 40, or 6 with --quick)",
    )
    _add_no_progress(demo_parser)
    _add_bench(commands)
    profile_parser = commands.add_parser(
        "profile",
        help="run a training script with every statecore loader traced; write each loader's "
        "Chrome/Perfetto trace, timeline PNG and verdict",
    )
    profile_parser.add_argument(
        "--out",
        default="statecore-profile",
        metavar="DIR",
        help="the folder for the outputs (default: statecore-profile)",
    )
    profile_parser.add_argument("script", help="the training script, as for `python script.py`")
    _add_no_progress(profile_parser)
    profile_parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="the script's own arguments"
    )
    replay_parser = commands.add_parser(
        "replay",
        help="re-drive the scheduler through a flight recorder's file (named in the error that "
        "wrote it), check every invariant and print the trace",
    )
    replay_parser.add_argument("file", help="the flight recorder's JSON file")
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(arguments)
    if args.command == "replay":
        from statecore.tools.replay import replay_file

        return replay_file(args.file)
    if args.command == "profile":
        from statecore.tools.profile import profile

        return profile(args.script, args.script_args, args.out, progress_bar=args.progress)
    if args.command == "bench":
        return _bench(args, arguments)
    if args.command == "check":
        return check(args.processes, args.bench, args.verbose, args.progress)
    if args.command == "demo":
        from statecore.tools.demo import demo

        return demo(quick=args.quick, batches=args.batches, progress_bar=args.progress)
    from statecore.tools.diagram import mermaid

    sys.stdout.write(mermaid())
    return 0


def run() -> int:
    """`python -m statecore`: `main` with the process's arguments, for a shell's pipes.

    When the reader goes away (`... | head`), what was left to print has nobody to read it.
    The interpreter's own flush at exit would fail again and print a traceback, so stdout is
    pointed at /dev/null first, and the status is the one a shell gives a broken pipe.
    """
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 128 + signal.SIGPIPE
    return status
