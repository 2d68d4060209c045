"""Hypothesis settings shared by the suite's property tests."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from hisparse_conformance import plugin


def examples(default: int) -> settings:
    """`default` examples per test, unless --hisparse-examples says otherwise.

    No deadline: the first call on an accelerator compiles kernels, and CI machines stall. A failure
    prints its `@reproduce_failure` blob (hypothesis's default does not), which a vendor pastes to
    replay it elsewhere: `.hypothesis/` keeps it only on the machine that found it.
    """
    n = plugin.examples_override or default
    return settings(max_examples=n, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
