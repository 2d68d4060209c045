"""Helpers of the core tests: throwaway backend distributions and subprocess environments.

`write_dist` writes an installed-looking distribution (packages plus a `*.dist-info` folder with
METADATA and entry_points.txt) into a site folder; putting that folder on `sys.path` (in
process) or `PYTHONPATH` (in a subprocess) makes `importlib.metadata` see its
`hisparse.backends` entry points exactly as it sees a pip-installed vendor package.
"""

from __future__ import annotations

import importlib.metadata
import os
import textwrap
import uuid
from collections.abc import Mapping
from pathlib import Path

import pytest

from hisparse_core import registry
from hisparse_core.discovery import ENTRY_POINT_GROUP

HISPARSE_ENV = ("HISPARSE_BACKEND", "HISPARSE_PLUGINS", "HISPARSE_DISABLED_PLUGINS")

#: A concrete `Backend` test double: selection only needs to instantiate it.
FAKE_BACKEND_CLASS = '''
from hisparse_core.backend import Backend


class FakeBackend(Backend):
    name = "{name}"
    version = "1.0"
    capabilities = frozenset({{"index_sharing"}})  # what plugin_source's spec declares

    @property
    def device(self):
        import torch
        return torch.device("cpu")

    def create_host_pool(self, spec):
        raise NotImplementedError("test double: selection tests never allocate")

    def create_runtime(self, config):
        raise NotImplementedError("test double: selection tests never allocate")

    def create_transfer_engine(self, host_pool, runtimes):
        raise NotImplementedError("test double: selection tests never allocate")
'''


def plugin_source(name: str, factory: str, *, priority: int = 10, probe: str = "return None",
                  extra: str = "") -> str:
    """Source of an entry-point module registering one backend `name` with the given probe body."""
    return textwrap.dedent('''
        from hisparse_core import BackendSpec, hookimpl


        def probe():
            {probe}


        @hookimpl
        def hisparse_register_backends(register):
            register(BackendSpec(name={name!r}, factory={factory!r}, probe=probe, priority={priority},
                                 version="1.0", capabilities=frozenset({{"index_sharing"}}){extra}))
        ''').format(name=name, factory=factory, priority=priority, probe=probe, extra=extra)


def write_dist(site: Path, dist: str, files: Mapping[str, str], entry_points: Mapping[str, str],
               version: str = "1.0", group: str = ENTRY_POINT_GROUP) -> None:
    """Write `files` (relative path -> source) and `<dist>-<version>.dist-info` into `site`, its
    `entry_points` in `group` (default: hisparse.backends)."""
    for rel, text in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = [f"[{group}]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    info.joinpath("entry_points.txt").write_text("\n".join(lines) + "\n")


class FakeSite:
    """A site folder on `sys.path` for this test, holding throwaway backend distributions."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.prefix = f"hisparse_fake_{uuid.uuid4().hex[:8]}"
        self.dists: list[str] = []
        root.mkdir()
        monkeypatch.syspath_prepend(str(root))

    def backend(self, name: str, *, priority: int = 10, probe: str = "return None", plugin: str | None = None,
                factory_source: str | None = None, plugin_source_text: str | None = None,
                dist: str | None = None) -> str:
        """Add a distribution with plugin `plugin` (default: `name`) registering backend `name`.

        Returns the package name. `plugin_source_text` replaces the generated entry-point module.
        """
        package = f"{self.prefix}_{(plugin or name).replace('-', '_').replace('.', '_')}"
        factory = f"{package}.backend:FakeBackend"
        files = {
            f"{package}/__init__.py": "",
            f"{package}/plugin.py": plugin_source_text or plugin_source(name, factory, priority=priority, probe=probe),
            f"{package}/backend.py": factory_source if factory_source is not None
            else FAKE_BACKEND_CLASS.format(name=name),
        }
        dist_name = dist or f"{package.replace('_', '-')}"
        write_dist(self.root, dist_name, files, {plugin or name: f"{package}.plugin"})
        self.dists.append(dist_name)
        return package

    def entry_points(self) -> list[importlib.metadata.EntryPoint]:
        """This site's entry points only (the installed hisparse plugins left out)."""
        return [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
                if ep.dist is not None and ep.dist.name in self.dists]

    def registry(self, environ: Mapping[str, str] | None = None) -> registry.BackendRegistry:
        return registry.BackendRegistry.discover(self.entry_points(), environ or {})


def subprocess_env(*paths: Path, **extra: str) -> dict[str, str]:
    """os.environ without HISPARSE_* variables, with `paths` in front of PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in HISPARSE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def module_exists(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
