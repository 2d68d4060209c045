"""`hisparse generate` without a usable transformers (not installed, or a release outside the tested
range) is one line, exit status 2, before a backend is selected. Before, the registry's selection
and 'hisparse generate: backend reference_cpu (automatic: ...) on cpu' were logged first, then
'transformers is not installed' (and an unsupported release failed only after them too)."""

from __future__ import annotations

import importlib.metadata
import logging
import sys

import pytest

pytest.importorskip("transformers")

from hisparse_core import cli  # noqa: E402

ARGS = ["generate", "--prompts", "1", "--new-tokens", "1", "--max-prompt", "17", "--no-progress"]


def _refused(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> str:
    caplog.set_level(logging.INFO)
    assert cli.main(ARGS) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hisparse generate: error: "), err
    said = [r.getMessage() for r in caplog.records if r.name.startswith("hisparse")]
    assert not any("selected" in m or "backend" in m for m in said), said   # refused before any selection
    return err


def test_generate_without_transformers_is_one_line_before_the_backend(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)   # as if not installed
    err = _refused(capsys, caplog)
    assert "transformers is not installed; expected the transformers extra" in err, err


def test_generate_with_an_unsupported_transformers_is_one_line_before_the_backend(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.0.0" if name == "transformers" else real(name))
    err = _refused(capsys, caplog)
    assert "transformers 9.0.0 is not supported; expected transformers>=" in err, err
