"""Act on a training framework as soon as both it and statecore are imported, in either order.

Two frameworks need it:

- Lightning takes a census. The class `statecore.DataLoader` needs torch, so `import statecore`
  leaves it to the first use of `statecore.DataLoader` (PEP 562). Lightning, each time it asks
  a module for a loader, patches the `__init__` of every subclass of torch's DataLoader that
  exists at that moment, to record the arguments it may later rebuild the loader from (with a
  distributed sampler, say). A class first built inside that moment is not patched: Lightning
  would record statecore's own call to torch's `__init__` instead of the user's, and rebuild a
  loader without its statecore arguments. So the class is built before it can ask.
- HF accelerate replaces. `Accelerator.prepare` wraps a loader in one of its own around a torch
  loader it builds anew; statecore's `Accelerator.prepare_data_loader` hook
  (`statecore.executors.frameworks.keep_statecore_under_accelerate`) puts a statecore loader
  back inside, so it has to be in place before the first `prepare`.

So once such a framework is loaded, the action runs at once, and while none is, a one-shot
import hook runs it as soon as one has finished importing, whichever of statecore and the
framework comes first. Only the frameworks trigger it, not torch: worker processes import
torch too, and should not spend their start-up importing a loader facade they never use.

Nothing here imports torch; each hook costs a set lookup per import until it fires.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType

__all__ = ["CENSUS_TAKERS", "REPLACERS", "build_before_a_census", "when_imported"]

CENSUS_TAKERS = frozenset({"lightning", "lightning_fabric", "pytorch_lightning"})
"""Top-level packages that patch the DataLoader subclasses existing when they ask for a loader."""
REPLACERS = frozenset({"accelerate"})
"""Top-level packages that replace a loader they are given by one of torch's, built anew."""


def build_before_a_census(build: Callable[[], object]) -> None:
    """Call `build` now if a census taker is loaded, else right after the first one loads."""
    when_imported(CENSUS_TAKERS, build)


def when_imported(names: frozenset[str], action: Callable[[], object]) -> None:
    """Call `action` now if one of the top-level packages `names` is loaded, else right after
    the first of them loads."""
    if names & sys.modules.keys():
        _quietly(action)
    else:
        sys.meta_path.insert(0, _Watch(names, action))


def _quietly(build: Callable[[], object]) -> None:
    # Building early is a courtesy to the framework: if it fails, the first use of
    # statecore.DataLoader builds the class again and raises there, where it can be seen.
    with contextlib.suppress(Exception):
        build()


class _Watch:
    """A meta path finder that finds nothing: it wraps the loader of the first of `names`."""

    def __init__(self, names: frozenset[str], build: Callable[[], object]) -> None:
        self._names = names
        self._build: Callable[[], object] | None = build

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name not in self._names or self._build is None:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: ModuleSpec | None = find(name, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = cast("Loader", _ThenBuild(spec.loader, self))
            return spec
        return None

    def fire(self) -> None:
        build, self._build = self._build, None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        if build is not None:
            _quietly(build)


class _ThenBuild:
    """A module loader that runs the framework's own loader, then the watch's action."""

    def __init__(self, loader: Any, watch: _Watch) -> None:
        self._loader = loader
        self._watch = watch

    def __getattr__(self, name: str) -> Any:
        # Resource readers and the like are the framework loader's business.
        return getattr(self._loader, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            # Give the module its own loader back: nothing after the import sees this one.
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
        self._watch.fire()
