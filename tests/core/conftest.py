"""Fixtures of the core tests: a clean registry per test, and a throwaway site of backend dists."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from core_support import HISPARSE_ENV, FakeSite

from hisparse_core import registry


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test discovers afresh, with no HISPARSE_* selection or filter variables set."""
    monkeypatch.setattr(registry, "_registry", None)
    for var in HISPARSE_ENV:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSite]:
    site = FakeSite(tmp_path / "site", monkeypatch)
    yield site
    for mod in [m for m in sys.modules if m.startswith(site.prefix)]:
        del sys.modules[mod]
