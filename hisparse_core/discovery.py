"""Finding backends: entry points, pluggy registration and probes, turned into listed entries.

One discovery pass, run by `hisparse_core.registry` the first time a process lists or selects a
backend:

1. Read the `hisparse.backends` entry points (one per plugin; the entry name is the plugin's
   name, and by convention the name of the backend it provides). `HISPARSE_DISABLED_PLUGINS`
   and `HISPARSE_PLUGINS` filter them by that name before anything is imported.
2. Import each plugin module and register it with a pluggy `PluginManager` for the project
   "hisparse", then `check_pending()` so a misspelt hook fails that plugin only. Any failure
   makes the plugin *broken* (listed with its error, logged once at WARNING); the other plugins
   carry on. pluggy's own `load_setuptools_entrypoints` is not used because it does not guard
   the import.
3. Call `hisparse_register_backends(register)` plugin by plugin and collect the `BackendSpec`s.
   A backend name registered twice is an error naming both plugins; neither backend of that
   name can be selected until one is removed or disabled.
4. For each spec, check its `api_version` and run its probe. The result is one `BackendEntry`
   per backend: *available*, *unavailable* (with the probe's reason) or *broken* (with the
   error and its traceback).

Nothing here imports a backend class: `factory` strings are resolved on selection.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.metadata
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from hisparse_core import hookspecs
from hisparse_core.backend import API_VERSION, BackendSpec, Capability
from hisparse_core.errors import a_or_an

logger = logging.getLogger(__name__)

#: Entry-point group whose entries name backend plugin modules.
ENTRY_POINT_GROUP = "hisparse.backends"
#: Comma-separated plugin (entry-point) names to load; when set, every other plugin is skipped.
ENV_PLUGINS = "HISPARSE_PLUGINS"
#: Comma-separated plugin (entry-point) names never to load.
ENV_DISABLED_PLUGINS = "HISPARSE_DISABLED_PLUGINS"

#: What vendor code (a plugin's import, its hook, a probe, a command's add_parser) may raise without
#: ending the process: an SDK that calls sys.exit() on a machine without its device makes that
#: backend (or command) broken or unavailable, like any other error.
VENDOR_ERRORS = (Exception, SystemExit)


def vendor_output_to_stderr() -> contextlib.AbstractContextManager[object]:
    """Where vendor code runs (a plugin's import and hook, a probe, a backend class's import and
    constructor, a command module's import and `add_parser`): what it prints goes to stderr, so
    hisparse's stdout holds only its own output (`hisparse backends --json | jq`). Python-level
    writes only; a library writing to file descriptor 1 itself is not caught."""
    return contextlib.redirect_stdout(sys.stderr)


def import_factory(factory: str) -> object:
    """The object a `module:qualname` factory names (a `BackendSpec`'s); raises what the import or
    an attribute lookup raises where it names none."""
    module_name, _, qualname = factory.partition(":")
    found: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
_FACTORY_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class BackendStatus(enum.StrEnum):
    """Whether a listed backend can be selected in this process."""

    AVAILABLE = "available"
    #: Registered and importable in principle, but its probe (or API version, or a plugin
    #: filter) says it cannot run here. Expected on machines without the hardware.
    UNAVAILABLE = "unavailable"
    #: Its plugin failed to import or register, or its factory failed to import: a bug or a
    #: broken install, shown with the error.
    BROKEN = "broken"


@dataclass(frozen=True, slots=True)
class BackendEntry:
    """One line of `hisparse backends`: a backend (or a plugin that failed before naming one).

    - `name`: the backend name; for a plugin that was skipped or broke before registering, its
      entry-point name.
    - `status`, `reason`: why it is not available (probe reason, API mismatch, filter, or the
      one-line error of a broken plugin); None when available.
    - `priority`, `version`, `capabilities`, `api_version`, `description`, `factory`: from the
      `BackendSpec`; None / empty when no spec was registered.
    - `plugin`, `distribution`, `distribution_version`: where it came from.
    - `error`: the formatted traceback of the failure, if any (shown by `hisparse backends -v`).
    """

    name: str
    status: BackendStatus
    priority: int | None = None
    version: str | None = None
    capabilities: tuple[str, ...] = ()
    reason: str | None = None
    plugin: str | None = None
    distribution: str | None = None
    distribution_version: str | None = None
    api_version: int | None = None
    description: str = ""
    factory: str | None = None
    error: str | None = None

    @property
    def available(self) -> bool:
        return self.status is BackendStatus.AVAILABLE

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (status as its string value, capabilities as a list)."""
        return {
            "name": self.name, "status": self.status.value, "priority": self.priority, "version": self.version,
            "capabilities": list(self.capabilities), "reason": self.reason, "plugin": self.plugin,
            "distribution": self.distribution, "distribution_version": self.distribution_version,
            "api_version": self.api_version, "description": self.description, "factory": self.factory,
            "error": self.error,
        }


@dataclass(frozen=True, slots=True)
class Discovery:
    """The outcome of one pass: every entry, the specs of the registered backends, the manager."""

    entries: tuple[BackendEntry, ...]
    specs: Mapping[str, BackendSpec]
    plugin_manager: pluggy.PluginManager


def parse_name_list(value: str | None) -> frozenset[str] | None:
    """`"a, b,"` -> {"a", "b"}; None (variable unset) stays None, so "" means "no names"."""
    if value is None:
        return None
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def error_summary(exc: BaseException, limit: int = 400) -> str:
    """`"Type: message"` on one line (pluggy's validation errors put the point on a later line)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def format_error(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@dataclass(slots=True)
class _Plugin:
    name: str
    module: object
    distribution: str | None
    distribution_version: str | None

    @property
    def label(self) -> str:
        where = f"{self.distribution} {self.distribution_version}" if self.distribution else "no distribution"
        return f"plugin {self.name!r} ({where})"


@dataclass(slots=True)
class _Claim:
    spec: BackendSpec
    plugin: _Plugin


@dataclass(slots=True)
class _Registrar:
    """The `register` callable handed to one plugin's `hisparse_register_backends`."""

    plugin: _Plugin
    claims: dict[str, _Claim]
    conflicts: dict[str, str]
    added: list[str] = field(default_factory=list)

    def __call__(self, spec: BackendSpec) -> None:
        _validate_spec(spec, self.plugin)
        prior = self.claims.get(spec.name)
        if prior is not None:
            message = (f"backend name {spec.name!r} is registered twice: by {prior.plugin.label} and by "
                       f"{self.plugin.label}; uninstall one, or disable one with {ENV_DISABLED_PLUGINS}")
            self.conflicts[spec.name] = message
            raise ValueError(message)
        self.claims[spec.name] = _Claim(spec, self.plugin)
        self.added.append(spec.name)


def _validate_spec(spec: object, plugin: _Plugin) -> None:
    where = f"{plugin.label} registered"
    if not isinstance(spec, BackendSpec):
        raise TypeError(f"{where} {spec!r} ({type(spec).__name__}); expected a hisparse_core.BackendSpec")
    if not isinstance(spec.name, str) or not _NAME_RE.fullmatch(spec.name):
        raise ValueError(f"{where} a backend named {spec.name!r}; expected letters, digits, '_', '.' or '-'")
    if not isinstance(spec.factory, str) or not _FACTORY_RE.fullmatch(spec.factory):
        raise ValueError(f"{where} backend {spec.name!r} with factory {spec.factory!r}; expected 'module:Class'")
    if not callable(spec.probe):
        raise TypeError(f"{where} backend {spec.name!r} with probe {spec.probe!r}; expected a callable")
    if isinstance(spec.priority, bool) or not isinstance(spec.priority, int):
        raise TypeError(f"{where} backend {spec.name!r} with priority {spec.priority!r}; expected an int")
    if isinstance(spec.api_version, bool) or not isinstance(spec.api_version, int):
        raise TypeError(f"{where} backend {spec.name!r} with api_version {spec.api_version!r}; expected an int")
    if not isinstance(spec.version, str):
        raise TypeError(f"{where} backend {spec.name!r} with version {spec.version!r}; expected a str")
    caps = spec.capabilities
    if isinstance(caps, str) or not isinstance(caps, Iterable) or not all(isinstance(c, str) for c in caps):
        raise TypeError(f"{where} backend {spec.name!r} with capabilities {caps!r}; expected a frozenset of str")


def _dist_of(ep: importlib.metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    try:
        return dist.name, dist.version
    except Exception:  # a distribution with unreadable metadata still names its plugins
        return None, None


def _skipped_entry(ep: importlib.metadata.EntryPoint, reason: str) -> BackendEntry:
    dist, dist_version = _dist_of(ep)
    return BackendEntry(name=ep.name, status=BackendStatus.UNAVAILABLE, reason=reason, plugin=ep.name,
                        distribution=dist, distribution_version=dist_version)


def _broken_plugin_entry(plugin: _Plugin, reason: str, error: str | None) -> BackendEntry:
    return BackendEntry(name=plugin.name, status=BackendStatus.BROKEN, reason=reason, plugin=plugin.name,
                        distribution=plugin.distribution, distribution_version=plugin.distribution_version,
                        error=error)


class _Pass:
    """State of one discovery pass (kept out of the registry, which only sees the result)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.allow = parse_name_list(environ.get(ENV_PLUGINS))
        self.blocked = parse_name_list(environ.get(ENV_DISABLED_PLUGINS)) or frozenset()
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.entries: list[BackendEntry] = []
        self.plugins: list[_Plugin] = []
        self.claims: dict[str, _Claim] = {}
        self.conflicts: dict[str, str] = {}

    def warn_unmatched_filters(self, installed: set[str]) -> None:
        """A filter naming no installed plugin is most likely a typo: say so, and what is installed."""
        names = ", ".join(sorted(installed)) or "none"
        for var, wanted in ((ENV_PLUGINS, self.allow), (ENV_DISABLED_PLUGINS, self.blocked)):
            unknown = sorted((wanted or frozenset()) - installed)
            if not unknown:
                continue
            effect = ""
            if var == ENV_PLUGINS and not (self.allow or frozenset()) & installed:
                effect = ", so no plugin is loaded"
            logger.warning("%s names %s, which %s no installed hisparse plugin%s; installed plugins: %s",
                           var, ", ".join(repr(n) for n in unknown), "is" if len(unknown) == 1 else "are", effect,
                           names)

    def broken(self, plugin: _Plugin, exc: BaseException, stage: str) -> None:
        summary = error_summary(exc)
        logger.warning("hisparse backend %s failed to %s and is listed as broken: %s "
                       "(`hisparse backends -v` shows the traceback)", plugin.label, stage, summary)
        self.entries.append(_broken_plugin_entry(plugin, summary, format_error(exc)))

    def load(self, ep: importlib.metadata.EntryPoint) -> None:
        dist, dist_version = _dist_of(ep)
        if ep.name in self.blocked:
            self.pm.set_blocked(ep.name)
            logger.debug("hisparse plugin %r skipped: listed in %s", ep.name, ENV_DISABLED_PLUGINS)
            self.entries.append(_skipped_entry(ep, f"plugin {ep.name!r} is disabled by {ENV_DISABLED_PLUGINS}"))
            return
        if self.allow is not None and ep.name not in self.allow:
            allowed = ", ".join(sorted(self.allow)) or "<empty>"
            logger.debug("hisparse plugin %r skipped: not in %s=%s", ep.name, ENV_PLUGINS, allowed)
            self.entries.append(_skipped_entry(ep, f"plugin {ep.name!r} is not in {ENV_PLUGINS} ({allowed})"))
            return
        plugin = _Plugin(ep.name, None, dist, dist_version)
        taken = next((p for p in self.plugins if p.name == ep.name), None)
        if taken is not None:
            self.broken(plugin, ValueError(f"plugin name {ep.name!r} ({ep.value}) is already used by "
                                           f"{taken.label}; each {ENTRY_POINT_GROUP} entry needs its own name"),
                        "register")
            return
        try:
            plugin.module = ep.load()
        except VENDOR_ERRORS as exc:
            self.broken(plugin, exc, "import")
            return
        try:
            hash(plugin.module)
        except TypeError:
            # pluggy keeps plugins in sets: one unhashable object would fail every plugin's collect.
            self.broken(plugin, TypeError(
                f"entry point {ep.value!r} is {a_or_an(type(plugin.module).__name__)} object, which is unhashable; "
                "expected a module (or a class) holding the @hookimpl hisparse_register_backends"), "register")
            return
        try:
            self.pm.register(plugin.module, name=ep.name)
        except Exception as exc:
            self.broken(plugin, exc, "register")
            return
        try:
            self.pm.check_pending()
        except Exception as exc:
            self.pm.unregister(plugin.module)
            self.broken(plugin, exc, "register")
            return
        logger.debug("hisparse %s loaded from %s", plugin.label, ep.value)
        self.plugins.append(plugin)

    def collect(self) -> None:
        modules = [p.module for p in self.plugins]
        for plugin in self.plugins:
            others = [m for m in modules if m is not plugin.module]
            call = self.pm.subset_hook_caller("hisparse_register_backends", remove_plugins=others)
            registrar = _Registrar(plugin, self.claims, self.conflicts)
            try:
                call(register=registrar)
            except VENDOR_ERRORS as exc:
                for name in registrar.added:
                    del self.claims[name]
                self.broken(plugin, exc, "register its backends")
                continue
            if not registrar.added and not call.get_hookimpls():
                self.broken(plugin, LookupError(
                    f"{plugin.label} registered no backends: it has no @hisparse_core.hookimpl "
                    "hisparse_register_backends(register)"), "register its backends")
            elif not registrar.added:
                self.broken(plugin, LookupError(
                    f"{plugin.label} registered no backends: its hisparse_register_backends never called "
                    "register(BackendSpec(...))"), "register its backends")

    def probe_all(self) -> dict[str, BackendSpec]:
        specs: dict[str, BackendSpec] = {}
        for name, claim in self.claims.items():
            if name in self.conflicts:
                logger.warning("hisparse backend %r is listed as broken: %s", name, self.conflicts[name])
                self.entries.append(_spec_entry(claim, BackendStatus.BROKEN, self.conflicts[name]))
                continue
            specs[name] = claim.spec
            self.entries.append(_probe(claim))
        return specs


def _spec_entry(claim: _Claim, status: BackendStatus, reason: str | None, error: str | None = None) -> BackendEntry:
    spec, plugin = claim.spec, claim.plugin
    return BackendEntry(
        name=spec.name, status=status, priority=spec.priority, version=spec.version,
        capabilities=tuple(sorted(spec.capabilities)), reason=reason, plugin=plugin.name,
        distribution=plugin.distribution, distribution_version=plugin.distribution_version,
        api_version=spec.api_version, description=spec.description, factory=spec.factory, error=error)


def _probe(claim: _Claim) -> BackendEntry:
    spec = claim.spec
    unknown = sorted(set(spec.capabilities) - Capability.ALL)
    if unknown:
        logger.warning("hisparse backend %r declares capabilities %s that hisparse does not know; known: %s",
                       spec.name, unknown, sorted(Capability.ALL))
    if spec.api_version != API_VERSION:
        return _spec_entry(claim, BackendStatus.UNAVAILABLE,
                           f"built for hisparse backend API version {spec.api_version}; "
                           f"this hisparse provides API version {API_VERSION}")
    try:
        verdict = spec.probe()
    except VENDOR_ERRORS as exc:
        logger.warning("hisparse backend %r: its probe raised %s; listed as unavailable",
                       spec.name, error_summary(exc))
        return _spec_entry(claim, BackendStatus.UNAVAILABLE, f"probe raised {error_summary(exc)}", format_error(exc))
    if verdict is None:
        return _spec_entry(claim, BackendStatus.AVAILABLE, None)
    if isinstance(verdict, str) and verdict.strip():
        return _spec_entry(claim, BackendStatus.UNAVAILABLE, verdict.strip())
    return _spec_entry(claim, BackendStatus.UNAVAILABLE,
                       f"probe returned {verdict!r} ({type(verdict).__name__}); expected None (can run) "
                       "or a non-empty reason string")


def _sort_key(entry: BackendEntry) -> tuple[int, int, str]:
    rank = {BackendStatus.AVAILABLE: 0, BackendStatus.UNAVAILABLE: 1, BackendStatus.BROKEN: 2}[entry.status]
    return rank, -(entry.priority if entry.priority is not None else -(2**63)), entry.name


def discover(entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
             environ: Mapping[str, str] | None = None) -> Discovery:
    """Run one discovery pass.

    :param entry_points: the plugins to consider; default: every installed entry point of the
        `hisparse.backends` group (tests pass their own).
    :param environ: where `HISPARSE_PLUGINS` / `HISPARSE_DISABLED_PLUGINS` are read; default
        `os.environ`.
    :returns: entries sorted available first, then by priority (highest first), then by name.
    """
    state = _Pass(os.environ if environ is None else environ)
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    entry_points = list(entry_points)
    state.warn_unmatched_filters({ep.name for ep in entry_points})
    with vendor_output_to_stderr():
        for ep in sorted(entry_points, key=lambda ep: (ep.name, ep.value)):
            state.load(ep)
        state.collect()
        specs = state.probe_all()
    entries = tuple(sorted(state.entries, key=_sort_key))
    summary = ", ".join(f"{e.name}={e.status.value}" for e in entries) or "none"
    logger.debug("hisparse backend discovery: %s", summary)
    return Discovery(entries, specs, state.pm)
