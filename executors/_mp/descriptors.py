"""What to tell the user when this process runs out of file descriptors.

Run by the main process, where the descriptors pile up: each worker holds pipes and a
sentinel here, each buffer it maps may hold one (`leases`), and under torch's default sharing
strategy every tensor torch shares holds one. A descriptor sent over a socket to a process with
no room for it is dropped by the kernel, and the standard library then reports "received 0
items of ancdata", deep in the resource sharer. `explain_exhaustion` turns that (and EMFILE)
into an error naming the limit, what holds the descriptors and what to do.
"""

from __future__ import annotations

import errno
import os

import torch.multiprocessing

__all__ = ["explain_exhaustion", "sharing_strategy", "unreceived"]


def sharing_strategy() -> str:
    """torch.multiprocessing's sharing strategy, as set_sharing_strategy() last set it."""
    strategy: str = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
    return strategy


# A descriptor sent over a socket to a process with no room for it is dropped by the kernel, and
# the standard library reports "received 0 items of ancdata". That is taken for exhaustion when
# the process holds at least its limit less this many.
_NEAR_LIMIT = 8


def explain_exhaustion(error: BaseException) -> BaseException:
    """`error`, or where it comes from this process running out of file descriptors, an error
    that says so: the limit, what holds the descriptors, and what to do (`error` its cause)."""
    explained = _out_of_descriptors(error)
    if explained is None:
        return error
    clear = RuntimeError(explained)
    clear.__cause__ = error
    return clear


def unreceived(error: BaseException, which: str, what: str) -> str:
    """The error to raise when a message uses buffer `which`, which failed to arrive."""
    explained = _out_of_descriptors(error)
    if explained is not None:
        return f"{explained} ({which} could not be received)"
    return f"{which} is unknown: {what}: {error!r}"


def _out_of_descriptors(error: BaseException) -> str | None:
    """What to tell the user if `error` (or what caused it) is this process out of descriptors."""
    limit = _descriptor_limit()
    held: dict[str, int] | None = None
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno == errno.EMFILE:
            break
        if isinstance(cause, RuntimeError) and "ancdata" in str(cause) and limit is not None:
            held = _held_descriptors()
            if sum(held.values()) + _NEAR_LIMIT >= limit:
                break
        cause = cause.__cause__ or cause.__context__
    else:
        return None
    if held is None:
        held = _held_descriptors()
    kinds = ", ".join(f"{count} {kind}" for kind, count in held.items() if count) or "none listed"
    if sharing_strategy() == "file_system":
        holders = ""
        remedies = ""
    else:
        holders = (
            " Under torch's sharing strategy 'file_descriptor' (its default), every tensor "
            "torch shares with this process holds one for as long as it lives (a batch kept "
            "beyond what the workers' buffers hold travels that way), and so does each buffer "
            "of the workers that this process maps."
        )
        remedies = (
            ", or call torch.multiprocessing.set_sharing_strategy('file_system') at the start "
            "of the program, so that neither holds one"
        )
    return (
        f"this process (pid {os.getpid()}) ran out of file descriptors: its limit "
        f"(RLIMIT_NOFILE) is {'unlimited' if limit is None else limit}, and it has "
        f"{sum(held.values())} open ({kinds}). Each DataLoader worker process holds a few "
        f"here (its task and result pipes, and its sentinel).{holders} Raise the limit "
        "(`ulimit -n` in the shell that starts Python, or "
        "resource.setrlimit(resource.RLIMIT_NOFILE, ...) before the loader starts)"
        f"{remedies}, or keep fewer batches alive at once."
    )


def _descriptor_limit() -> int | None:
    """This process's limit on open descriptors (the soft RLIMIT_NOFILE); None if there is none."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if limit == resource.RLIM_INFINITY else limit


# What a descriptor's target starts with, in /proc/self/fd, and what to call it.
_KINDS = (
    (("/dev/shm/", "/memfd:"), "shared-memory segments"),
    (("pipe:",), "pipes"),
    (("socket:",), "sockets"),
    (("",), "other files"),
)


def _held_descriptors() -> dict[str, int]:
    """This process's open descriptors, counted by kind; empty where /proc cannot tell."""
    try:
        numbers = [int(entry) for entry in os.listdir("/proc/self/fd")]
    except OSError as error:
        # Listing the directory takes a descriptor itself; at the limit, try every number.
        limit = _descriptor_limit()
        if error.errno != errno.EMFILE or limit is None or limit > 1 << 16:
            return {}
        numbers = list(range(limit))
    held = dict.fromkeys((name for _, name in _KINDS), 0)
    for number in numbers:
        try:
            target = os.readlink(f"/proc/self/fd/{number}")
        except OSError:
            continue  # not open, or the directory's own descriptor, closed since
        kind = next(name for prefixes, name in _KINDS if target.startswith(prefixes))
        held[kind] += 1
    return held
