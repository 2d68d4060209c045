"""`Backend.check_settings()` in the registry: a bad setting of the backend's own is the user's
mistake, raised unchanged before the backend is constructed, with nothing marked broken and no
fallback; anything else it raises is a vendor bug, handled as a constructor that raises.

Throwaway backends (`fake_site`) whose `check_settings` reads `ACME_TILE` and whose constructor
counts its calls in `CONSTRUCTED`.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging

import pytest
from core_support import FAKE_BACKEND_CLASS as FAKE_BACKEND
from core_support import FakeSite

from hisparse_core.backend import Backend
from hisparse_core.errors import BackendUnavailableError, InvalidInputError
from hisparse_core.registry import BackendStatus

CHECKING = '''
    CONSTRUCTED = []

    def __init__(self):
        type(self).CONSTRUCTED.append(1)

    @classmethod
    def check_settings(cls):
        import os

        from hisparse_core.errors import InvalidInputError

        print("acme: checking ACME_TILE")  # vendor chatter: stderr, never hisparse's stdout
        value = os.environ.get("ACME_TILE", "64")
        if value == "crash":
            raise RuntimeError("acme SDK: settings table missing")
        if value not in ("64", "128"):
            raise InvalidInputError(f"ACME_TILE={value!r} is not a tile size; expected 64 or 128")
'''


def _acme(fake_site: FakeSite, priority: int = 50) -> str:
    return fake_site.backend("acme", priority=priority, factory_source=FAKE_BACKEND.format(name="acme") + CHECKING)


def _constructed(package: str) -> int:
    return len(importlib.import_module(f"{package}.backend").FakeBackend.CONSTRUCTED)


def test_the_default_accepts_and_returns_none() -> None:
    assert Backend.check_settings() is None


@pytest.mark.parametrize("explicit", [True, False])
def test_a_bad_setting_is_raised_unchanged_before_construction_without_fallback_or_mark(
        fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, explicit: bool) -> None:
    package = _acme(fake_site)
    fake_site.backend("base", priority=1)
    reg = fake_site.registry()
    monkeypatch.setenv("ACME_TILE", "7")
    with caplog.at_level(logging.WARNING, logger="hisparse_core"), pytest.raises(InvalidInputError) as err:
        reg.select_backend("acme" if explicit else None)
    assert str(err.value) == "ACME_TILE='7' is not a tile size; expected 64 or 128"
    assert _constructed(package) == 0
    assert reg.get("acme").status is BackendStatus.AVAILABLE  # the user's mistake, not a broken backend
    assert caplog.records == []  # no "falling back" line: the fallback would hide the typo
    monkeypatch.setenv("ACME_TILE", "128")  # fixed: the same registry selects it
    assert reg.select_backend().name == "acme" and _constructed(package) == 1


def test_a_check_that_crashes_is_a_broken_backend_and_automatic_selection_falls_back(
        fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    package = _acme(fake_site)
    fake_site.backend("base", priority=1)
    reg = fake_site.registry()
    monkeypatch.setenv("ACME_TILE", "crash")
    with caplog.at_level(logging.WARNING, logger="hisparse_core"):
        assert reg.select_backend().name == "base"
    acme = reg.get("acme")
    assert acme.status is BackendStatus.BROKEN and _constructed(package) == 0
    assert acme.reason == (f"{package}.backend.FakeBackend.check_settings() raised RuntimeError: acme SDK: settings "
                           "table missing")
    assert "Traceback" in (acme.error or "")
    assert len(caplog.records) == 1 and "falling back to 'base'" in caplog.records[0].getMessage()
    with pytest.raises(BackendUnavailableError, match=r"'acme' is broken: .*check_settings\(\) raised RuntimeError"):
        reg.select_backend("acme")


def test_an_explicit_selection_of_a_crashing_check_names_check_settings(
        fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch) -> None:
    _acme(fake_site)
    reg = fake_site.registry()
    monkeypatch.setenv("ACME_TILE", "crash")
    with pytest.raises(BackendUnavailableError, match=r"^hisparse backend 'acme': .*\.FakeBackend\.check_settings\(\) "
                                                      r"raised RuntimeError: acme SDK"):
        reg.select_backend("acme")


def test_what_the_check_prints_goes_to_stderr(fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch) -> None:
    _acme(fake_site)
    reg = fake_site.registry()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        reg.select_backend("acme")
    assert out.getvalue() == "" and "acme: checking ACME_TILE" in err.getvalue()


def test_the_registry_checks_a_class_without_constructing_it(fake_site: FakeSite,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # What vLLM's op registration calls: no backend may be built there (a GPU backend would initialise CUDA).
    package = _acme(fake_site)
    reg = fake_site.registry()
    assert reg.check_settings("acme") is None
    monkeypatch.setenv("ACME_TILE", "huge")
    with pytest.raises(InvalidInputError, match="^ACME_TILE='huge' is not a tile size"):
        reg.check_settings("acme")
    assert _constructed(package) == 0 and reg.get("acme").available


def test_an_override_without_classmethod_is_refused_naming_the_fix(fake_site: FakeSite) -> None:
    source = FAKE_BACKEND.format(name="plain") + "\n    def check_settings(self):\n        return None\n"
    fake_site.backend("plain", factory_source=source)
    reg = fake_site.registry()
    with pytest.raises(BackendUnavailableError, match="defines check_settings\\(\\) without @classmethod; expected a "
                                                      "classmethod"):
        reg.select_backend("plain")
    assert reg.get("plain").status is BackendStatus.BROKEN
