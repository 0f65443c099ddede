"""Shared test setup: the Hypothesis profile (ci by default, see statecore.models.profiles)."""

from statecore.models.profiles import load_profile

load_profile()
