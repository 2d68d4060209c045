"""What the backend says about itself: the class's capabilities (what the suite gates on and what
runs) are the ones its plugin's `BackendSpec` advertises in `hisparse backends`, and name a row
format; its `check_settings()` accepts the run's environment and allocates nothing."""

from __future__ import annotations

import pytest
import torch

from hisparse_core.backend import Backend, Capability
from hisparse_core.discovery import import_factory
from hisparse_core.errors import BackendNotFoundError


def test_the_class_declares_what_its_plugin_advertises(hisparse_backend: Backend) -> None:
    from hisparse_core.registry import get_registry

    cls = type(hisparse_backend)
    try:
        spec = get_registry().spec(hisparse_backend.name)
    except BackendNotFoundError:
        pytest.skip(f"backend {hisparse_backend.name!r} is not registered through a plugin (a fixture override)")
    try:
        registered = import_factory(spec.factory)
    except Exception:  # noqa: BLE001 -- a factory that does not import is not the class under test
        registered = None
    if registered is not cls:  # by identity: a factory may name the class where a package re-exports it
        pytest.skip(f"the backend under test is {cls.__module__}:{cls.__qualname__}, not the registered "
                    f"{spec.factory} (a fixture override)")
    declared, actual = frozenset(spec.capabilities), frozenset(cls.capabilities)
    drift = []
    if declared - actual:
        drift.append(f"the BackendSpec advertises {sorted(declared - actual)} that {spec.factory} lacks")
    if actual - declared:
        drift.append(f"{spec.factory} declares {sorted(actual - declared)} that the BackendSpec does not advertise")
    assert declared == actual, "capability drift: " + ", and ".join(drift)
    # A misspelt name gates nothing: the tests of the capability meant are skipped as "lacks capability".
    assert actual <= Capability.ALL, (
        f"unknown capabilities {sorted(actual - Capability.ALL)}; expected names of hisparse_core.backend.Capability "
        f"({', '.join(sorted(Capability.ALL))}): the tests of a misspelt one are skipped as lacking it")


def test_the_backend_serves_a_row_format(hisparse_capabilities: frozenset[str]) -> None:
    # Every test that moves rows skips without a row format, so the rest of the suite would pass empty.
    formats = (Capability.FP8_DS_MLA, Capability.BF16_MLA)
    assert hisparse_capabilities & set(formats), (
        f"the backend declares no row format (capabilities: {sorted(hisparse_capabilities)}); expected "
        f"{', '.join(formats)} or both: every test that moves rows would skip")


def test_check_settings_accepts_the_runs_environment_and_allocates_nothing(hisparse_backend: Backend) -> None:
    # The registry ran it before constructing the backend under test, so the run's variables are accepted;
    # called again, on the class as vLLM's op registration calls it, it must say so and touch no memory.
    device = torch.device(hisparse_backend.device)
    on_gpu = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if on_gpu else 0
    assert type(hisparse_backend).check_settings() is None, "check_settings() returns None when it accepts"
    assert hisparse_backend.check_settings() is None
    if on_gpu:
        assert torch.cuda.memory_allocated(device) == before, "check_settings() allocated device memory"
