"""`python -m statecore demo`: every executor hands over torch's batches, and says how fast."""

from __future__ import annotations

import io
import os
import pickle
import re
import subprocess
import sys

import attrs
import pytest
import torch
import torch.utils.data

from statecore import Event, TaskCompleted
from statecore.executors import _registry
from statecore.executors._inline import InlineExecutor
from statecore.tools.cli import main
from statecore.tools.demo import Progress, SyntheticImages, compare_batches

# Runs a statecore command in a fresh interpreter in which Ray cannot be imported, as where it
# was never installed (tests/test_registry_optional.py plays it the same way).
_WITHOUT_RAY = (
    "import sys; sys.modules['ray'] = None\n"
    "from statecore.tools.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
_QUIET = {**os.environ, "PYTHONWARNINGS": "ignore"}


def _rows(stdout: str) -> set[str]:
    return {line.split()[0] for line in stdout.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def quick_demo_without_ray() -> subprocess.CompletedProcess[str]:
    """One run of the quick demo, shared by the tests of what it prints: each run starts every
    executor's workers and torch's, so the default tier runs it once."""
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_RAY, "demo", "--quick", "--batches", "2"],
        capture_output=True,
        text=True,
        timeout=280,
        env=_QUIET,
    )


@pytest.mark.timeout(300)
def test_the_quick_demo_matches_torch_and_prints_the_table(
    quick_demo_without_ray: subprocess.CompletedProcess[str],
) -> None:
    done = quick_demo_without_ray
    assert done.returncode == 0, done.stdout + done.stderr
    assert {"executor", "inline", "mp", "thread", "torch"} <= _rows(done.stdout), done.stdout
    assert "MISMATCH" not in done.stdout
    # stderr is a pipe here, not a terminal: one line per stage, no bar redrawn in place.
    assert "\r" not in done.stderr
    assert "demo: inline (num_workers=0) run 1/2 ..." in done.stderr.splitlines()


@pytest.mark.timeout(300)
def test_the_demo_runs_without_ray_and_says_it_skipped_it(
    quick_demo_without_ray: subprocess.CompletedProcess[str],
) -> None:
    done = quick_demo_without_ray
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ray: skipped, pip install -e '.[ray]'" in done.stdout.splitlines()
    assert "ray" not in _rows(done.stdout)


# With Ray installed the demo runs it too (a local Ray instance and its actors: about as long
# as the rest of the demo); what it prints is tested above, and Ray's batches against torch's in
# tests/test_ray_executor.py.
@pytest.mark.exhaustive
@pytest.mark.timeout(300)
def test_the_quick_demo_with_ray_installed_runs_ray_too_and_matches_torch() -> None:
    pytest.importorskip("ray")
    done = subprocess.run(
        [sys.executable, "-m", "statecore", "demo", "--quick"],
        capture_output=True,
        text=True,
        timeout=280,
        env=_QUIET,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert {"executor", "inline", "mp", "ray", "torch"} <= _rows(done.stdout), done.stdout
    assert "MISMATCH" not in done.stdout


def _batches(size: int = 12) -> list[object]:
    return list(torch.utils.data.DataLoader(SyntheticImages(size), batch_size=4))


def test_the_same_batches_match() -> None:
    assert compare_batches(_batches(), _batches()) is None


def test_a_changed_pixel_is_a_mismatch() -> None:
    expected, got = _batches(), _batches()
    got[1][0][2, 0, 5, 7] += 1  # type: ignore[index]
    assert compare_batches(expected, got) == "batch 1, [0]: 1 of 49152 values differ"


def test_a_wrong_label_is_a_mismatch() -> None:
    expected, got = _batches(), _batches()
    got[2][1][0] = 9  # type: ignore[index]
    assert compare_batches(expected, got) == "batch 2, [1]: 1 of 4 values differ"


def test_batches_out_of_order_are_a_mismatch() -> None:
    expected = _batches()
    got = [expected[1], expected[0], expected[2]]
    message = compare_batches(expected, got)
    assert message is not None and message.startswith("batch 0, [0]:")


def test_a_missing_or_extra_batch_is_a_mismatch() -> None:
    expected = _batches()
    assert compare_batches(expected, expected[:2]) == "2 batches instead of 3"
    assert compare_batches(expected[:2], expected) == "3 batches instead of 2"


def test_a_batch_of_another_type_or_shape_is_a_mismatch() -> None:
    expected = _batches()
    images, labels = expected[0]  # type: ignore[misc]
    assert compare_batches([expected[0]], [[images.float(), labels]]) == (
        "batch 0, [0]: torch.float32 of shape (4, 3, 64, 64) instead of "
        "torch.uint8 of shape (4, 3, 64, 64)"
    )
    assert compare_batches([expected[0]], [[images]]) == (
        "batch 0 is made differently: batch[0] instead of batch[0], batch[1]"
    )
    assert compare_batches([[1, "a"]], [[1, "b"]]) == "batch 0, [1]: 'b' instead of 'a'"


def test_the_images_are_the_same_in_every_process_and_pickle() -> None:
    dataset = SyntheticImages(5)
    image, label = dataset[3]
    assert image.shape == (3, 64, 64) and image.dtype == torch.uint8 and label == 3
    again, _ = pickle.loads(pickle.dumps(dataset))[3]
    assert torch.equal(image, again)
    assert not torch.equal(image, dataset[4][0])
    with pytest.raises(IndexError):
        dataset[5]


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_off_a_terminal_prints_a_line_per_stage() -> None:
    stream = io.StringIO()
    progress = Progress(total=100, stream=stream)
    progress.stage("inline run 1/2")
    progress.advance(60)
    progress.stage("mp run 1/2")
    progress.advance(40)
    progress.done("2 epochs loaded")
    assert stream.getvalue().splitlines() == [
        "demo: inline run 1/2 ...",
        "demo: mp run 1/2 ...",
        "demo: 2 epochs loaded",
    ]


def test_progress_on_a_terminal_is_a_tqdm_bar_named_for_the_loader_now_loading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    stream = Terminal()
    progress = Progress(total=4, stream=stream)
    progress.stage("inline run 1/1")
    assert re.search(r"inline run 1/1: +0%\|.*\| 0/4 \[", stream.getvalue())
    progress.advance(4)
    progress.done("1 epochs loaded")
    assert "demo: inline run 1/1 ..." not in stream.getvalue()
    assert stream.getvalue().endswith("demo: 1 epochs loaded\n")


def test_progress_told_not_to_show_prints_the_stage_lines_even_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CI", raising=False)
    stream = Terminal()
    progress = Progress(total=4, stream=stream, show=False)
    progress.stage("mp run 1/1")
    progress.advance(4)
    progress.done("1 epochs loaded")
    assert stream.getvalue().splitlines() == ["demo: mp run 1/1 ...", "demo: 1 epochs loaded"]


def test_the_demo_refuses_no_batches(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--batches", "0"]) == 2
    assert "--batches must be at least 1" in capsys.readouterr().err


class _Relabelling(InlineExecutor):
    """A broken executor: every label it hands over is one too high."""

    def poll(self, timeout: float | None) -> Event | None:
        event = super().poll(timeout)
        if isinstance(event, TaskCompleted):
            images, labels = event.payload  # type: ignore[misc]
            return attrs.evolve(event, payload=[images, labels + 1])
        return event


def test_a_loader_that_differs_fails_the_demo(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    registry = {"inline": _registry.BUILT_IN["inline"], "relabelling": (_Relabelling, True)}
    monkeypatch.setattr(_registry, "BUILT_IN", registry)
    assert main(["demo", "--quick", "--batches", "2"]) == 1
    out = capsys.readouterr().out
    assert (
        "MISMATCH (num_workers=0): relabelling did not hand over torch's batches: "
        "batch 0, [1]: 16 of 16 values differ"
    ) in out
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.strip()}
    assert rows["relabelling"] == "NO" and rows["inline"] == "yes" and rows["torch"] == "yes"
