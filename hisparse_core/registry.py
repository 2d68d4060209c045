"""The backend registry: which backends exist here, and which one a process uses.

    from hisparse_core.registry import get_registry, select_backend

    for entry in get_registry().entries():       # what `hisparse backends` prints
        print(entry.name, entry.status, entry.reason)
    backend = select_backend()                    # or select_backend("nvidia")

Discovery (`hisparse_core.discovery`) runs once per process, on first use; `get_registry(
reload=True)` runs it again. Selection:

- **Explicit**: the `name` argument, else `HISPARSE_BACKEND`. It must name an available backend;
  `auto` (any case) counts as unset in either (an argument `auto` defers to the variable, and
  `HISPARSE_BACKEND=auto` leaves the choice automatic);
  an unknown name raises `BackendNotFoundError`, an unavailable or broken one
  `BackendUnavailableError`. Both messages list the available backends and why every other one
  is not.
- **Automatic**: the available backend with the highest `priority`. Two available backends with
  the same highest priority are resolved by name (alphabetically first wins) and logged at
  WARNING, naming the tie and `HISPARSE_BACKEND` as the way to choose. Nothing available raises
  `BackendUnavailableError` with every backend's reason.

The chosen backend's `factory` class is imported and instantiated only then, after its
`check_settings()` (the backend's own environment variables): a bad setting raises its
`InvalidInputError` unchanged, with no fallback and nothing marked, since only the user can fix it.
A backend whose class fails there (it does not import, is not a concrete `Backend`, declares another
`name` than its spec's, no `version` or `capabilities` that are not a set of str, defines
`check_settings` without @classmethod, or its `check_settings()` raises anything else or its
constructor raises) is listed as broken from then on in this process: an explicit selection raises
the error (and logs nothing: the caller's one line says it), an automatic one logs one WARNING and falls back to the next available backend. A class whose `capabilities`
differ from its `BackendSpec`'s is reported at selection with one WARNING (the class's set is what
runs, and the listing takes it). A selection logs one INFO line: "hisparse backend 'X' selected
(explicit: ... | automatic: highest priority among [...]); unavailable: ...", once a process (a
selection that repeats one already logged, same backend, reason and listing, logs it at DEBUG).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import pluggy

from hisparse_core.backend import API_VERSION, Backend, BackendSpec
from hisparse_core.discovery import (
    ENTRY_POINT_GROUP,
    ENV_DISABLED_PLUGINS,
    ENV_PLUGINS,
    VENDOR_ERRORS,
    BackendEntry,
    BackendStatus,
    discover,
    error_summary,
    format_error,
    import_factory,
    vendor_output_to_stderr,
)
from hisparse_core.errors import BackendNotFoundError, BackendUnavailableError, InvalidInputError

__all__ = [
    "AUTO", "ENTRY_POINT_GROUP", "ENV_BACKEND", "ENV_DISABLED_PLUGINS", "ENV_PLUGINS", "BackendEntry", "BackendRegistry",
    "BackendStatus", "Selection", "get_registry", "is_auto", "list_backends", "resolve_backend_class",
    "select_backend",
]

logger = logging.getLogger(__name__)

#: Names the backend to use, as if passed to `select_backend(name)`.
ENV_BACKEND = "HISPARSE_BACKEND"
#: The name that asks for automatic selection wherever a backend name is taken (`HISPARSE_BACKEND`,
#: `select_backend(name)`, the plugins' backend settings): a user writes it where a setting needs a value.
AUTO = "auto"


def is_auto(value: object) -> bool:
    """Whether `value` asks for automatic selection (`auto`, any case, surrounding blanks ignored)."""
    return isinstance(value, str) and value.strip().lower() == AUTO


@dataclass(frozen=True, slots=True)
class Selection:
    """Which backend selection would pick, and why, without importing it.

    `source` is "argument", "HISPARSE_BACKEND" or "automatic"; `candidates` are the available
    backends that were considered (for automatic selection, the highest priority first).
    """

    name: str
    source: str
    candidates: tuple[BackendEntry, ...]

    @property
    def explicit(self) -> bool:
        return self.source != "automatic"

    def explanation(self) -> str:
        """The parenthesised "why" of the selection log line."""
        if self.explicit:
            return "explicit" if self.source == "argument" else f"explicit: {self.source}={self.name}"
        among = ", ".join(f"{e.name} ({e.priority})" for e in self.candidates)
        return f"automatic: highest priority among [{among}]"


def _why_not(entry: BackendEntry) -> str:
    return f"{entry.name} ({entry.status.value}: {entry.reason})"


class BackendRegistry:
    """The backends one discovery pass found, and selection among them.

    Obtain the process-wide instance with `get_registry()`. Entries are immutable snapshots; the
    only changes after discovery are made at selection: an available backend whose class fails to
    load becomes broken, and one whose class declares other capabilities than its spec is listed
    with the class's.
    """

    def __init__(self, entries: Iterable[BackendEntry], specs: Mapping[str, BackendSpec],
                 plugin_manager: pluggy.PluginManager) -> None:
        self._entries = list(entries)
        self._specs = dict(specs)
        self._pm = plugin_manager
        self._lock = threading.Lock()
        self._drift_reported: set[str] = set()
        self._selections_logged: set[tuple[str, str, str]] = set()

    @classmethod
    def discover(cls, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
                 environ: Mapping[str, str] | None = None) -> BackendRegistry:
        """Run discovery (see `hisparse_core.discovery.discover`) and wrap its result."""
        found = discover(entry_points, environ)
        return cls(found.entries, found.specs, found.plugin_manager)

    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        """The pluggy manager holding every plugin that loaded (for further hisparse hooks)."""
        return self._pm

    def spec(self, name: str) -> BackendSpec:
        """The `BackendSpec` its plugin registered for backend `name` (as registered, whatever
        selection found since); raises `BackendNotFoundError` if none was."""
        spec = self._specs.get(name)
        if spec is None:
            raise BackendNotFoundError(f"no hisparse backend named {name!r} was registered; "
                                       f"{self._inventory(exclude=None)}")
        return spec

    def entries(self) -> list[BackendEntry]:
        """Every backend and every skipped or broken plugin: available first, then by priority
        (highest first), then by name."""
        with self._lock:
            return list(self._entries)

    def available(self) -> list[BackendEntry]:
        return [e for e in self.entries() if e.available]

    def get(self, name: str) -> BackendEntry:
        """The entry of backend `name`; raises `BackendNotFoundError` listing the known names."""
        matches = [e for e in self.entries() if e.name == name]
        if not matches:
            raise BackendNotFoundError(f"no hisparse backend named {name!r}; {self._inventory(exclude=None)}")
        # A registered backend wins over a broken plugin that happens to share its name.
        return next((e for e in matches if e.factory is not None), matches[0])

    def choose(self, name: str | None = None, environ: Mapping[str, str] | None = None) -> Selection:
        """Decide which backend `select_backend(name)` would use, without importing it.

        Raises `BackendNotFoundError` / `BackendUnavailableError` exactly as `select_backend`.
        """
        env = os.environ if environ is None else environ
        source = "argument"
        if is_auto(name):
            name = None
        if name is None:
            value = env.get(ENV_BACKEND, "").strip()
            name = None if is_auto(value) else value or None
            source = ENV_BACKEND
        if name is not None:
            entry = self._require_available(name, source)
            return Selection(entry.name, source, (entry,))
        candidates = self.available()
        if not candidates:
            raise BackendUnavailableError(
                f"no hisparse backend is available here; {self._inventory(exclude=None)}. "
                "Run `hisparse backends -v` for details")
        top = max(e.priority or 0 for e in candidates)
        tied = sorted(e.name for e in candidates if (e.priority or 0) == top)
        if len(tied) > 1:
            logger.warning("hisparse backends %s tie at the highest priority %d; using %r (first by name). "
                           "Set %s to choose", tied, top, tied[0], ENV_BACKEND)
        ranked = tuple(sorted(candidates, key=lambda e: (-(e.priority or 0), e.name)))
        return Selection(tied[0], "automatic", ranked)

    def resolve_backend_class(self, name: str) -> type[Backend]:
        """Import the `factory` class of available backend `name`.

        Raises `BackendNotFoundError` for an unknown name and `BackendUnavailableError` for one
        that is unavailable or broken, or whose factory does not import, is not a concrete
        `hisparse_core.Backend` subclass, or declares another API version. A factory failure
        marks the backend broken for the rest of the process (not logged: the error says it).
        """
        return self._load_class(name)

    def _load_class(self, name: str) -> type[Backend]:
        entry = self._require_available(name, "argument")
        spec = self._specs[entry.name]
        try:
            with vendor_output_to_stderr():
                obj = import_factory(spec.factory)
        except VENDOR_ERRORS as exc:
            reason = f"factory {spec.factory!r} failed to import: {error_summary(exc)}"
            self._mark_broken(entry, reason, format_error(exc))
            raise BackendUnavailableError(
                f"hisparse backend {name!r}: {reason}. Run `hisparse backends -v` for details") from exc
        problem = _class_problem(obj, entry.name)
        if problem is not None:
            self._mark_broken(entry, f"factory {spec.factory!r} {problem}", None)
            raise BackendUnavailableError(f"hisparse backend {name!r}: factory {spec.factory!r} {problem}")
        assert isinstance(obj, type) and issubclass(obj, Backend)
        self._check_capabilities(entry, spec, obj)
        return obj

    def _check_capabilities(self, entry: BackendEntry, spec: BackendSpec, cls: type[Backend]) -> None:
        """Report a class whose capabilities differ from what its plugin advertised (once)."""
        declared, actual = frozenset(spec.capabilities), frozenset(cls.capabilities)
        if declared == actual or entry.name in self._drift_reported:
            return
        self._drift_reported.add(entry.name)
        parts = []
        if declared - actual:
            parts.append(f"its BackendSpec declares {sorted(declared - actual)} that {spec.factory} does not")
        if actual - declared:
            parts.append(f"{spec.factory} declares {sorted(actual - declared)} that its BackendSpec does not")
        logger.warning("hisparse backend %r: capability drift: %s; the class's set %s is what runs and what the "
                       "conformance suite tests, so it is listed from now on: make the plugin's BackendSpec and the "
                       "class agree", entry.name, "; ".join(parts), sorted(actual))
        with self._lock:
            self._entries = [replace(e, capabilities=tuple(sorted(actual))) if e is entry else e
                             for e in self._entries]

    def select_backend(self, name: str | None = None) -> Backend:
        """Choose a backend (see the module docstring), import its class and return a new instance.

        Each call constructs a new instance; a worker process selects once and keeps it. In
        automatic selection a backend whose class fails to load is marked broken and the next
        available one is tried, with one WARNING. The backend's `check_settings()` runs before it is
        constructed; its `InvalidInputError` (a bad setting) is raised as is, without a fallback.
        """
        selection = self.choose(name)
        while True:
            try:
                backend = self._instantiate(selection.name)
                break
            except BackendUnavailableError as exc:
                if selection.explicit:
                    raise
                failed = selection.name
                try:
                    selection = self.choose(environ={})
                except BackendUnavailableError as none_left:
                    logger.warning("hisparse backend %r could not be loaded and is now listed as broken: %s; "
                                   "no other backend is available", failed, self.get(failed).reason)
                    raise none_left from exc
                logger.warning("hisparse backend %r could not be loaded and is now listed as broken: %s; falling "
                               "back to %r (select %r explicitly to get the error)", failed, self.get(failed).reason,
                               selection.name, failed)
        others = [e for e in self.entries() if not e.available]
        unavailable = ", ".join(_why_not(e) for e in others) or "none"
        # Once a process: a vLLM worker selects for the ops and again for the connector, the same way.
        said = (selection.name, selection.explanation(), unavailable)
        with self._lock:
            first = said not in self._selections_logged
            self._selections_logged.add(said)
        logger.log(logging.INFO if first else logging.DEBUG, "hisparse backend %r selected (%s); unavailable: %s",
                   selection.name, selection.explanation(), unavailable)
        return backend

    def check_settings(self, name: str) -> None:
        """Run `check_settings()` of available backend `name` without constructing it (what
        `hisparse_vllm.ops.register_ops` does, where building a GPU backend would initialise CUDA).

        Imports its class as `resolve_backend_class` does. A bad setting raises the backend's
        `InvalidInputError` unchanged and leaves the backend available; any other exception marks it
        broken and raises `BackendUnavailableError` naming `check_settings()`.
        """
        self._check_settings(name, self._load_class(name))

    def _check_settings(self, name: str, cls: type[Backend]) -> None:
        try:
            with vendor_output_to_stderr():
                cls.check_settings()
        except InvalidInputError:
            raise  # the user's setting, not a broken backend: no fallback hides it
        except VENDOR_ERRORS as exc:
            reason = f"{cls.__module__}.{cls.__qualname__}.check_settings() raised {error_summary(exc)}"
            self._mark_broken(self.get(name), reason, format_error(exc))
            raise BackendUnavailableError(f"hisparse backend {name!r}: {reason}") from exc

    def _instantiate(self, name: str) -> Backend:
        cls = self._load_class(name)
        self._check_settings(name, cls)
        try:
            with vendor_output_to_stderr():
                return cls()
        except VENDOR_ERRORS as exc:
            reason = f"{cls.__module__}.{cls.__qualname__}() raised {error_summary(exc)}"
            self._mark_broken(self.get(name), reason, format_error(exc))
            raise BackendUnavailableError(f"hisparse backend {name!r}: {reason}") from exc

    def _require_available(self, name: str, source: str) -> BackendEntry:
        via = "" if source == "argument" else f" (from {source})"
        matches = [e for e in self.entries() if e.name == name]
        if not matches:
            raise BackendNotFoundError(
                f"no hisparse backend named {name!r}{via}; {self._inventory(exclude=None)}{_uninstalled_hint(name)}")
        entry = self.get(name)
        if not entry.available:
            raise BackendUnavailableError(
                f"hisparse backend {name!r}{via} is {entry.status.value}: {entry.reason}; "
                f"{self._inventory(exclude=name)}. Run `hisparse backends -v` for details")
        return entry

    def _inventory(self, exclude: str | None) -> str:
        entries = [e for e in self.entries() if e.name != exclude]
        available = ", ".join(f"{e.name} (priority {e.priority})" for e in entries if e.available) or "none"
        others = [e for e in entries if not e.available]
        text = f"available: {available}"
        if others:
            text += "; not available: " + ", ".join(_why_not(e) for e in others)
        return text

    def _mark_broken(self, entry: BackendEntry, reason: str, error: str | None) -> None:
        # Not logged: every caller raises the reason (an automatic selection's fallback logs it), and a
        # WARNING too would say it twice above the caller's one line (`hisparse run`, the conformance run).
        with self._lock:
            self._entries = [replace(e, status=BackendStatus.BROKEN, reason=reason, error=error) if e is entry else e
                             for e in self._entries]


def _uninstalled_hint(name: str) -> str:
    """Where a vendor's `hisparse_<name>` imports but registered nothing (the package put on
    `PYTHONPATH`, or its entry points changed without a reinstall), "no backend named" said nothing
    of why."""
    package = f"hisparse_{name}"
    if not package.isidentifier():
        return ""
    try:
        found = importlib.util.find_spec(package)  # a top-level name: found without importing it
    except (ImportError, ValueError):
        return ""
    if found is None or "hisparse" in importlib.metadata.packages_distributions().get(package, []):
        return ""  # hisparse's own packages (hisparse_core, hisparse_vllm, ...) are no backend's
    where = f" (at {found.origin})" if found.origin else ""
    return (f". Package {package} imports{where} but no installed distribution has a {ENTRY_POINT_GROUP!r} entry "
            f"point that registers {name!r}: install its distribution (pip install -e DIR). Entry points are read "
            "from installed metadata, not from PYTHONPATH, and an editable install rereads them only when reinstalled")


def _class_problem(obj: object, name: str) -> str | None:
    if not isinstance(obj, type) or not issubclass(obj, Backend):
        return f"is {obj!r}, not a subclass of hisparse_core.Backend"
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        return f"is abstract: it does not implement {missing}"
    if obj.api_version != API_VERSION:
        return (f"declares api_version {obj.api_version}; this hisparse provides API version {API_VERSION}")
    # A subclass of another backend that keeps its name would be reported, and tested, as that one.
    declared = getattr(obj, "name", None)
    if declared != name:
        said = "declares no name" if declared is None else f"declares name {declared!r}"
        return f"{said}; expected {name!r}, the name its BackendSpec registers (set the class's `name`)"
    # Called on the class (the registry and vLLM's op registration construct nothing first): an override
    # without @classmethod would fail there as a vendor bug, so it is said here, naming the fix.
    if not isinstance(inspect.getattr_static(obj, "check_settings", None), (classmethod, staticmethod)):
        return "defines check_settings() without @classmethod; expected a classmethod (it runs before construction)"
    version = getattr(obj, "version", None)
    if not isinstance(version, str):
        said = "declares no version" if version is None else f"declares version {version!r}"
        return f"{said}; expected a str (the class's `version`, shown with the backend)"
    caps = getattr(obj, "capabilities", None)
    if isinstance(caps, str) or not isinstance(caps, Iterable) or not all(isinstance(c, str) for c in caps):
        return (f"declares capabilities {caps!r} ({type(caps).__name__}); expected a frozenset of str "
                "(Capability names)")
    return None


_registry: BackendRegistry | None = None
# Re-entrant: a probe that (wrongly) asks for the registry fails loudly instead of deadlocking.
_registry_lock = threading.RLock()


def get_registry(reload: bool = False) -> BackendRegistry:
    """The process-wide registry, discovered on first call; `reload=True` discovers again
    (re-reading the entry points and `HISPARSE_PLUGINS` / `HISPARSE_DISABLED_PLUGINS`)."""
    global _registry
    with _registry_lock:
        if _registry is None or reload:
            _registry = BackendRegistry.discover()
        return _registry


def list_backends() -> list[BackendEntry]:
    """`get_registry().entries()`."""
    return get_registry().entries()


def select_backend(name: str | None = None) -> Backend:
    """`get_registry().select_backend(name)`: a new instance of the chosen backend."""
    return get_registry().select_backend(name)


def resolve_backend_class(name: str) -> type[Backend]:
    """`get_registry().resolve_backend_class(name)`: the class of available backend `name`."""
    return get_registry().resolve_backend_class(name)
