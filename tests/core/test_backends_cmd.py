"""`hisparse backends [--json] [-v]`, run in process through `hisparse_core.cli.main`."""

from __future__ import annotations

import json

import pytest
from core_support import FAKE_BACKEND_CLASS as FAKE_BACKEND
from core_support import FakeSite

from hisparse_core import registry
from hisparse_core.cli import main


@pytest.fixture
def listed(fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch) -> FakeSite:
    """Three fake backends (available, unavailable, broken) as the only ones the CLI sees."""
    fake_site.backend("fast", priority=20)
    fake_site.backend("gpu", priority=90, probe="return 'no CUDA device'")
    fake_site.backend("bad", plugin_source_text="raise RuntimeError('exploded on import')\n")
    monkeypatch.setattr(registry, "_registry", fake_site.registry())
    return fake_site


def test_table_lists_every_backend_with_status_and_reason(listed: FakeSite, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "STATUS", "PRIORITY", "VERSION", "CAPABILITIES", "REASON"]
    rows = {line.split()[0]: line.split(None, 5) for line in out[1:4]}
    assert rows["fast"] == ["fast", "available", "20", "1.0", "index_sharing", "-"]
    assert rows["gpu"] == ["gpu", "unavailable", "90", "1.0", "index_sharing", "no CUDA device"]
    assert rows["bad"][:5] == ["bad", "broken", "-", "-", "-"]
    assert rows["bad"][5] == "RuntimeError: exploded on import"
    assert out[-1] == "selected: fast (automatic: highest priority among [fast (20)])"


def test_verbose_adds_distribution_and_tracebacks(listed: FakeSite, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "-v"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    # 100 columns (not a terminal) cannot hold -v's columns and REASON's longest word side by side:
    # each reason goes on its own line under its backend's row.
    assert header == ["NAME", "STATUS", "PRIORITY", "VERSION", "CAPABILITIES", "PLUGIN", "DISTRIBUTION", "API"]
    assert "    reason: no CUDA device" in out.splitlines()
    assert f"{listed.prefix.replace('_', '-')}-fast==1.0" in out
    assert "Traceback (most recent call last):" in out
    assert "RuntimeError: exploded on import" in out.split("bad:\n", 1)[1]
    assert f"factory: {listed.prefix}_fast.backend:FakeBackend" in out


def test_json_lists_objects_with_the_documented_keys(listed: FakeSite, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_name = {d["name"]: d for d in data}
    assert set(by_name) == {"fast", "gpu", "bad"}
    for item in data:
        assert {"name", "status", "priority", "version", "capabilities", "reason", "selected",
                "distribution", "error"} <= set(item)
    assert (by_name["fast"]["status"], by_name["fast"]["priority"], by_name["fast"]["capabilities"],
            by_name["fast"]["reason"], by_name["fast"]["selected"]) == ("available", 20, ["index_sharing"], None, True)
    assert (by_name["gpu"]["status"], by_name["gpu"]["reason"], by_name["gpu"]["selected"]) == (
        "unavailable", "no CUDA device", False)
    assert by_name["bad"]["status"] == "broken" and "exploded on import" in by_name["bad"]["error"]


def test_selected_line_reports_a_bad_hisparse_backend(listed: FakeSite, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HISPARSE_BACKEND", "gpu")
    assert main(["backends"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("selected: none (hisparse backend 'gpu' (from HISPARSE_BACKEND) is unavailable: "
                           "no CUDA device; available: fast (priority 20)")


def test_no_backends_at_all(fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(registry, "_registry", fake_site.registry())
    assert main(["backends"]) == 0
    assert "no hisparse backends installed" in capsys.readouterr().out
    assert main(["backends", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_installed_listing_shows_nvidia_unavailable_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    if shutil.which("nvidia-smi"):
        pytest.skip("this machine may have an NVIDIA GPU")
    assert main(["backends", "--json"]) == 0
    nvidia = {d["name"]: d for d in json.loads(capsys.readouterr().out)}["nvidia"]
    assert nvidia["status"] == "unavailable" and nvidia["reason"], nvidia


def test_what_vendor_code_prints_goes_to_stderr_not_into_the_json(
        fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A vendor SDK that prints a banner when the plugin imports, its probe runs, or its backend
    class imports and is built: `hisparse backends --json | jq` (what docs/cli.md tells scripts to
    run) got the banner in front of the JSON and failed to parse it."""
    package = fake_site.backend("loud", priority=20, probe='print("Acme SDK 3.1: probing"); return None',
                                factory_source='print("Acme SDK 3.1: loaded")\n'
                                               + FAKE_BACKEND.format(name="loud").replace(
                                                   "    @property", "    def __init__(self):\n"
                                                   "        print('Acme SDK 3.1: device opened')\n\n    @property", 1))
    plugin = fake_site.root / package / "plugin.py"
    plugin.write_text('print("Acme SDK 3.1: plugin")\n' + plugin.read_text())
    monkeypatch.setattr(registry, "_registry", None)
    monkeypatch.setenv("HISPARSE_PLUGINS", "loud")  # the installed plugins are listed, not loaded
    assert main(["backends", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [d["name"] for d in json.loads(out) if d["status"] == "available"] == ["loud"], out
    assert "Acme SDK 3.1: plugin" in err and "Acme SDK 3.1: probing" in err, err
    assert type(registry.select_backend("loud")).__name__ == "FakeBackend"
    out, err = capsys.readouterr()
    assert out == "" and "Acme SDK 3.1: loaded" in err and "Acme SDK 3.1: device opened" in err, (out, err)

