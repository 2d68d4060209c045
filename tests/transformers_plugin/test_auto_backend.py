"""Automatic backend selection for a model on a given device (`handle._auto_backend_on`): a CPU
model on a machine whose best backend is a GPU's gets the best backend that runs on the CPU, and the
log says what was passed over (found on the H200: the CPU tests were handed the nvidia backend)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("transformers")

from hisparse_transformers import handle  # noqa: E402 - after the skip: it imports transformers


@dataclass
class _Entry:
    name: str


@dataclass
class _Backend:
    name: str
    device: torch.device


class _Registry:
    def __init__(self, names: list[str]) -> None:
        self.names = names

    def choose(self, name: None) -> object:
        return type("Selection", (), {"candidates": tuple(_Entry(n) for n in self.names)})()


def test_a_cpu_model_gets_the_best_cpu_backend(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    devices = {"gpu_a": torch.device("cuda", 0), "gpu_b": torch.device("cuda", 0), "cpu_ref": torch.device("cpu")}
    order = ["gpu_a", "gpu_b", "cpu_ref"]
    monkeypatch.setattr(handle, "get_registry", lambda: _Registry(order))
    monkeypatch.setattr(handle, "select_backend",
                        lambda name=None: _Backend(name or order[0], devices[name or order[0]]))
    with caplog.at_level(logging.INFO, logger="hisparse_transformers.handle"):
        chosen = handle._auto_backend_on(torch.device("cpu"))
    assert chosen.name == "cpu_ref"
    line = next(r.getMessage() for r in caplog.records if "automatic backend" in r.getMessage())
    assert "gpu_a (runs on cuda:0)" in line and "gpu_b (runs on cuda:0)" in line, line
    # the registry's own choice is kept where it runs on the model's device
    assert handle._auto_backend_on(torch.device("cuda", 0)).name == "gpu_a"


def test_no_backend_on_the_device_leaves_the_registry_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handle, "get_registry", lambda: _Registry(["gpu_a"]))
    monkeypatch.setattr(handle, "select_backend", lambda name=None: _Backend("gpu_a", torch.device("cuda", 0)))
    assert handle._auto_backend_on(torch.device("cpu")).name == "gpu_a"  # enable() then names the mismatch


def test_a_bad_setting_of_a_backend_on_the_device_is_raised_not_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    # The registry raises a backend's check_settings refusal (HISPARSE_TRITON_SPLIT='7' ...) unchanged;
    # passed over with an INFO line, the user's typo went unseen and another backend ran.
    from hisparse_core.errors import InvalidInputError

    devices = {"gpu_a": torch.device("cuda", 0), "cpu_tuned": torch.device("cpu"), "cpu_ref": torch.device("cpu")}

    def select(name: str | None = None) -> _Backend:
        if name == "cpu_tuned":
            raise InvalidInputError("CPU_TUNED_KNOB='7' is not a knob value; expected 1 or 2")
        return _Backend(name or "gpu_a", devices[name or "gpu_a"])

    monkeypatch.setattr(handle, "get_registry", lambda: _Registry(["gpu_a", "cpu_tuned", "cpu_ref"]))
    monkeypatch.setattr(handle, "select_backend", select)
    with pytest.raises(InvalidInputError, match="CPU_TUNED_KNOB='7'"):
        handle._auto_backend_on(torch.device("cpu"))
