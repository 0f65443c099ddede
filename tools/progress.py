"""Progress bars for the long commands (`bench`, `check`, `profile`), drawn by tqdm on stderr.

A bar is drawn only where someone is watching: stderr is a terminal, the command was not told
`--no-progress`, and the environment does not say it is a CI job (`CI` set to anything but
`0`, `false`, `no`, `off` or nothing) or a terminal that cannot redraw (`TERM=dumb`). See
`wanted`.

Anywhere else (a pipe, a log file, CI) nothing is drawn and nothing extra is printed: a
command's own lines (`Bar.note`) are printed as plain lines, exactly as without a bar. On a
terminal those lines go above the bar, which stays at the bottom and is erased when closed,
so that what the command prints next (a table on stdout, say) starts on a clean line.

The measuring and exploring code knows nothing of this module: it takes plain callbacks, and
the commands turn those into `Bar.advance` or `Bar.goto` calls.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Bar", "wanted"]

_NO = frozenset({"", "0", "false", "no", "off"})
"""Values of `CI` that do not mean "this is a CI job"."""


def wanted(stream: TextIO | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a bar may be drawn on `stream` (stderr): a terminal, not in CI, not `TERM=dumb`."""
    stream = sys.stderr if stream is None else stream
    environ = os.environ if environ is None else environ
    if environ.get("CI", "").strip().lower() not in _NO or environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a stand-in without isatty, or a closed file
        return False


class Bar:
    """A progress bar over `total` steps (None: not known yet) on stderr, where one is
    `wanted` and `show` is true; where not, a bar that draws nothing.

    `live` says which. Use it as a context manager; closing it twice is harmless.
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        unit: str = "it",
        description: str = "",
        show: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.live = show and wanted(self.stream)
        self._tqdm: Any = None
        if self.live:
            from tqdm import tqdm  # only where a bar is drawn: logs and pipes never pay for it

            self._tqdm = tqdm(
                total=total,
                unit=unit,
                desc=description,
                file=self.stream,
                leave=False,
                dynamic_ncols=True,
            )

    def advance(self, steps: int = 1, description: str | None = None) -> None:
        """`steps` more done; `description`, if given, replaces the text before the bar."""
        if self._tqdm is None:
            return
        if description is not None:
            self._tqdm.set_description_str(description, refresh=False)
        self._tqdm.update(steps)

    def goto(self, done: int, total: int | None = None, description: str | None = None) -> None:
        """`done` steps done out of `total` (if given, it replaces the total), with
        `description` (if given) before the bar: for callers that count for themselves."""
        if self._tqdm is None:
            return
        if total is not None and total != self._tqdm.total:
            self._tqdm.total = total
        self.advance(done - self._tqdm.n, description)
        if description is not None:
            self._tqdm.refresh()  # a new description shows now, not at the next update

    def describe(self, description: str) -> None:
        """Show `description` before the bar now (a new stage of the command)."""
        if self._tqdm is not None:
            self._tqdm.set_description_str(description, refresh=True)

    def note(self, message: str) -> None:
        """Print `message` as a line of its own on the bar's stream: above the bar when it is
        drawn, as a plain line when not."""
        if self._tqdm is None:
            print(message, file=self.stream, flush=True)
        else:
            self._tqdm.write(message, file=self.stream)

    def close(self) -> None:
        """Erase the bar, if drawn. Harmless twice."""
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None

    def __enter__(self) -> Bar:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
