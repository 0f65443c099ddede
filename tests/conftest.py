"""Shared test setup: the Hypothesis profile (ci by default, see statecore.models.profiles), and
the fixtures more than one test module uses."""

from _wire import pair

from statecore.models.profiles import load_profile

__all__ = ["pair"]

load_profile()
