"""Workers leave no temporary directory behind, however their loader ends.

A worker that shares a file descriptor (a buffer for a large tensor, or a tensor sent torch's
way) starts the standard library's resource sharer, which listens on a unix socket in a
temporary directory. A script points TMPDIR at a fresh directory, runs loaders that end in
different ways, and lists what is left there after each; the test also checks that nothing is
left once the script has exited. The main process's own temporary directories (a fork server's
socket, say) are its business and go when it exits, so the script leaves them out of its lists.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = textwrap.dedent(
    """
    import json
    import multiprocessing
    import os
    import sys
    import tempfile
    import time

    import multiprocess
    import torch
    from torch.utils.data import Dataset

    import statecore

    TMP = tempfile.gettempdir()


    class Tensors(Dataset):
        # Item i: a 1 MiB tensor, which travels in a buffer, and a parameter, which travels
        # torch's way; items from `block_from` on take ten minutes.
        def __init__(self, n, block_from):
            self.n, self.block_from = n, block_from

        def __len__(self):
            return self.n

        def __getitem__(self, index):
            if index >= self.block_from:
                time.sleep(600)
            return {
                "big": torch.full((1 << 18,), float(index)),
                "parameter": torch.nn.Parameter(torch.ones(2)),
                "pid": os.getpid(),
            }


    def left():
        own = {
            multiprocessing.current_process()._config.get("tempdir"),
            multiprocess.current_process()._config.get("tempdir"),
        }
        return sorted(
            entry for entry in os.listdir(TMP) if os.path.join(TMP, entry) not in own
        )


    def loader(n, block_from=None, **options):
        return statecore.DataLoader(
            Tensors(n, n if block_from is None else block_from),
            batch_size=None,
            num_workers=2,
            multiprocessing_context=sys.argv[1],
            **options,
        )


    if __name__ == "__main__":
        report = {}
        epochs = loader(6)
        for _ in range(3):
            assert [int(item["big"][0]) for item in epochs] == list(range(6))
        report["epochs"] = left()

        for item in loader(64):
            break
        del item
        report["break"] = left()

        # Workers busy with a batch nobody will read are terminated at shutdown.
        iterator = iter(loader(64, block_from=4))
        assert len({next(iterator)["pid"] for _ in range(4)}) == 2
        del iterator
        report["terminated"] = left()

        persistent = iter(loader(6, persistent_workers=True))
        next(persistent)
        print(json.dumps(report), flush=True)
        # The interpreter exits with persistent workers alive.
    """
)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """An empty directory with a short path: the sockets made in it must fit a unix socket's
    108 bytes, which pytest's own temporary paths (under pytest-xdist, longer still) need not."""
    made = Path(tempfile.mkdtemp(prefix="sc-tmp-"))
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


@pytest.mark.parametrize(
    "method", ["fork", "forkserver", pytest.param("spawn", marks=pytest.mark.exhaustive)]
)
def test_workers_leave_nothing_in_the_temporary_directory(
    tmp_path: Path, short_tmp: Path, method: str
) -> None:
    tmp = short_tmp
    script = tmp_path / "tempdirs.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), method],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == {"epochs": [], "break": [], "terminated": []}
    assert os.listdir(tmp) == []
