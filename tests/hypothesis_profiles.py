"""The suite's hypothesis profiles, chosen by `HISPARSE_HYPOTHESIS_PROFILE` (`tests/conftest.py` loads it).

- `ci` (the default, and what CI runs): derandomized, so every run of the same tree draws the
  same examples and a pass or a failure repeats; no example database, no deadline (shared CI
  machines stall), and a failure prints its `@reproduce_failure` blob.
- `dev`: randomized, with the example database in `.hypothesis/`, for local exploration.
- `long`: randomized, no database, and `examples(n)` gives 10 times the examples (the state
  machines use it): a bug hunt, `HISPARSE_HYPOTHESIS_PROFILE=long python -m pytest -q
  tests/coordinator/test_stateful.py --hypothesis-show-statistics`.

Tests that pin their own `max_examples` keep it in every profile except where they ask
`examples(n)`; the derandomized/randomized choice applies to all of them.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

ENV = "HISPARSE_HYPOTHESIS_PROFILE"
#: How many times `examples(n)` multiplies n, per profile.
SCALE = {"ci": 1, "dev": 1, "long": 10}


def selected() -> str:
    """The profile `ENV` names (`ci` when unset); a name outside `SCALE` is refused."""
    name = os.environ.get(ENV, "").strip() or "ci"
    if name not in SCALE:
        raise SystemExit(f"{ENV}={name!r}: expected one of {', '.join(sorted(SCALE))}")
    return name


def register() -> str:
    """Register the three profiles and load the selected one; returns its name."""
    settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("long", derandomize=False, database=None, deadline=None, print_blob=True,
                              max_examples=1000, suppress_health_check=[HealthCheck.too_slow])
    name = selected()
    settings.load_profile(name)
    return name


def examples(n: int) -> int:
    """`n` examples, times the selected profile's scale (10 under `long`)."""
    return n * SCALE[selected()]
