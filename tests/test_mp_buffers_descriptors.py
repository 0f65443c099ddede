"""File descriptors and permissions of the shared-memory buffers.

What the tests check: a loader that runs out of file descriptors says so, naming the limit, what
holds the descriptors and what to do, instead of failing deep inside the executor; under torch's
`file_system` sharing strategy the main process holds no descriptor per buffer; and a buffer can
be read and written by its owner only, as torch's own segments.
"""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
import torch.multiprocessing
from _wire import NUMEL, Filled

import statecore
from statecore.executors._mp import BufferSender, pool

GONE_WITHIN = 120
# A float32 sample this long is 1 MiB: large enough for a buffer.
BUFFER_NAME = "/memfd:statecore-buffer-"


def expected(first: int) -> torch.Tensor:
    """The batch of two `Filled` items that starts at item `first`."""
    return torch.stack([torch.full((NUMEL,), float(first + k)) for k in range(2)])


def descriptors_to_buffers(pid: int | str = "self") -> list[str]:
    """The descriptors process `pid` holds open on a worker's buffer, each as it is named."""
    found = []
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{entry}")
        except OSError:
            continue
        if target.startswith(BUFFER_NAME):
            found.append(target)
    return found


def mapped_buffers() -> set[str]:
    """The workers' buffers this process maps, as /proc/self/maps names them."""
    with open("/proc/self/maps") as maps:
        return {line.split(maxsplit=5)[5].strip() for line in maps if BUFFER_NAME in line}


# --- running out of descriptors ------------------------------------------------------------------

# Run in a child interpreter, whose descriptor limit the test may lower: python -c EXHAUSTING
# LIMIT WORKERS FLOATS, for samples of FLOATS float32 values. The consumer keeps every batch:
# once the workers' buffer pools are spent, each large batch travels torch's way and holds a
# descriptor in the main process for as long as it is kept. Small batches travel in the
# message and hold none, so with too low a limit for the workers, starting them runs out.
EXHAUSTING = textwrap.dedent(
    """
    import resource
    import sys

    import torch
    from torch.utils.data import Dataset

    import statecore

    class Filled(Dataset):
        def __len__(self):
            return 400

        def __getitem__(self, index):
            return torch.full((floats,), float(index))

    limit, workers, floats = (int(argument) for argument in sys.argv[1:])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    loader = statecore.DataLoader(
        Filled(), batch_size=2, num_workers=workers, multiprocessing_context="fork", timeout=60
    )
    kept = []
    try:
        for batch in loader:
            kept.append(batch)
    except Exception as error:
        print(f"{type(error).__name__}: {error}")
        sys.exit(3)
    print(f"all {len(kept)} batches arrived")
    """
)


@pytest.mark.parametrize(
    ("limit", "workers", "floats", "holders"),
    [
        pytest.param(96, 2, 1 << 16, "shared-memory segments", id="receiving-kept-batches"),
        pytest.param(16, 8, 1, "pipes", id="starting-workers"),
    ],
)
@pytest.mark.timeout(GONE_WITHIN + 60)
def test_running_out_of_descriptors_names_the_limit_what_holds_them_and_the_remedies(
    limit: int, workers: int, floats: int, holders: str
):
    child = subprocess.run(
        [sys.executable, "-c", EXHAUSTING, str(limit), str(workers), str(floats)],
        capture_output=True,
        text=True,
        timeout=GONE_WITHIN,
    )
    assert child.returncode == 3, child.stdout + child.stderr
    message = child.stdout
    assert "ran out of file descriptors" in message, message
    assert f"RLIMIT_NOFILE) is {limit}" in message, message
    assert holders in message, message
    assert "ulimit -n" in message, message
    assert "set_sharing_strategy('file_system')" in message, message


# --- the file_system strategy ------------------------------------------------------------------


@pytest.fixture
def file_system_strategy() -> Iterator[None]:
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


@pytest.mark.timeout(120)
def test_under_the_file_system_strategy_the_main_process_holds_no_descriptor_per_buffer(
    file_system_strategy: None,
):
    loader = statecore.DataLoader(
        Filled(40), batch_size=2, num_workers=2, multiprocessing_context="fork"
    )
    kept = []
    for index, batch in enumerate(loader):
        if index < 10:
            kept.append(batch)
        assert torch.equal(batch, expected(2 * index))
        if index == 9:
            assert len(mapped_buffers()) >= 10  # the kept batches are in buffers...
            assert descriptors_to_buffers() == []  # ...that hold no descriptor here
    for index, batch in enumerate(kept):
        assert torch.equal(batch, expected(2 * index))
    # Mapped without a descriptor, a buffer is still unmapped once nothing uses it.
    del kept, batch, loader
    gc.collect()
    assert mapped_buffers() == set()


# --- permissions -------------------------------------------------------------------------------


def test_a_buffer_can_be_read_and_written_by_its_owner_only(monkeypatch: pytest.MonkeyPatch):
    # Nothing fetches the buffer's descriptor here: no handle for the resource sharer.
    monkeypatch.setattr(pool, "DupFd", lambda fd: None)
    sender = BufferSender()
    batch = sender.begin()
    _, lent = sender.dumps(torch.full((NUMEL,), 1.0), batch)
    sender.end(batch)
    try:
        assert lent
        modes = []
        for entry in os.listdir("/proc/self/fd"):
            path = f"/proc/self/fd/{entry}"
            try:
                if os.readlink(path).startswith(f"{BUFFER_NAME}{os.getpid()}-"):
                    modes.append(stat.S_IMODE(os.stat(path).st_mode))
            except OSError:
                continue
        assert modes and all(mode == 0o600 for mode in modes), [oct(mode) for mode in modes]
    finally:
        for buffer in list(sender.buffers.values()):
            sender._close(buffer)
