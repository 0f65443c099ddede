"""Hypothesis profiles for the model-based tests.

- `ci` (the default): derandomized, fixed example counts, no deadline. The same examples run
  every time, so a loaded two-core machine can neither flake nor time a test out.
- `exhaustive`: derandomized like `ci`, with twice the examples: the
  budget of the exhaustive test tier's machine runs (`pytest -m exhaustive`), which ask for it
  by name.
- `thorough`: many more, longer, random runs for a soak; select it with
  `STATECORE_HYPOTHESIS_PROFILE=thorough`.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

__all__ = ["PROFILE_VARIABLE", "load_profile"]

PROFILE_VARIABLE = "STATECORE_HYPOTHESIS_PROFILE"

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "exhaustive",
    settings.get_profile("ci"),
    max_examples=300,
)
settings.register_profile(
    "thorough",
    max_examples=3000,
    stateful_step_count=150,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def load_profile() -> str:
    """Load the profile named by the environment (default `ci`) and return its name."""
    name = os.environ.get(PROFILE_VARIABLE, "ci")
    settings.load_profile(name)
    return name
