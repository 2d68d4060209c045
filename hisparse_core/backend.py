"""The backend interface: what an accelerator vendor implements, and how it is described."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

# Annotation-only imports: plugins import BackendSpec from here, and a plugin module must not
# pull in torch (every process that lists backends imports every plugin).
if TYPE_CHECKING:
    import torch

    from hisparse_core.geometry import RuntimeConfig
    from hisparse_core.host_pool import HostPool, HostPoolSpec
    from hisparse_core.runtime import CacheRuntime
    from hisparse_core.transfer import TransferEngine
    from hisparse_core.vllm_ops import VllmHiSparseOps

#: Version of the Backend/HostPool/CacheRuntime/TransferEngine interfaces. A backend built for
#: another API version is listed as unavailable.
API_VERSION = 1


class Capability:
    """Capability names a backend may declare. The conformance suite skips, with the reason, a
    test that needs a capability the backend does not declare."""

    FP8_DS_MLA = "row_format:fp8_ds_mla"
    BF16_MLA = "row_format:bf16_mla"
    SPECULATIVE_UNION = "speculative_union"  # several consecutive rows per request resolved as one union
    INDEX_SHARING = "index_sharing"  # num_layers > 1: followers replay the leader's miss plan
    SHARED_HOST_POOL = "shared_host_pool"  # HostPoolSpec(shared=True) across processes
    CUDA_GRAPH = "cuda_graph"  # resolve(validate=False) + gather capturable in a CUDA graph
    ASYNC_TRANSFERS = "async_transfers"  # enqueued and completed may be reported at different polls
    VLLM_OPS = "vllm_ops"  # Backend.vllm_ops(): vLLM's four _C_cache_ops.hisparse_* ops (hisparse_core/vllm_ops.py)

    ALL: ClassVar[frozenset[str]] = frozenset(
        {FP8_DS_MLA, BF16_MLA, SPECULATIVE_UNION, INDEX_SHARING, SHARED_HOST_POOL, CUDA_GRAPH, ASYNC_TRANSFERS,
         VLLM_OPS})


class Backend(ABC):
    """Factories for one platform's host pool, runtimes and transfer engine.

    A backend class is named by a `BackendSpec` that its plugin registers through the
    `hisparse_register_backends` hook; the registry imports and instantiates it only when it is
    selected, and only after its probe said it can run here and `check_settings()` accepted the
    backend's own settings. Construction must be cheap and must not allocate device memory;
    allocation happens in the factories. One instance serves one worker process.
    """

    name: ClassVar[str]
    version: ClassVar[str]
    api_version: ClassVar[int] = API_VERSION
    capabilities: ClassVar[frozenset[str]] = frozenset()

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device runtimes live on (e.g. `cpu`, `cuda:0`): where callers (the worker's tables,
        the conformance suite's device caches) allocate tensors for this backend. Read often (the
        worker's log line, `describe()`, the suite's report header), so it is cheap and never raises;
        a selected backend whose `describe()` raises fails the conformance run before collection."""

    @abstractmethod
    def create_host_pool(self, spec: HostPoolSpec) -> HostPool:
        """Allocate (or, for a shared pool on rank > 0, map) the host pool.

        Raises `CapacityError` if the memory cannot be had, `InvalidInputError` for a spec the
        backend cannot serve (e.g. `shared=True` without the SHARED_HOST_POOL capability). The
        caller (`HiSparseWorker`) owns the pool and releases it at shutdown.
        """

    @abstractmethod
    def create_runtime(self, config: RuntimeConfig) -> CacheRuntime:
        """Build an unbound runtime for one index group, with its state and workspace allocated
        on `device`. Raises `InvalidInputError` for a geometry the backend cannot serve.

        Called by `HiSparseWorker` once per cache group when it is built, right after
        `create_host_pool` (a raise here releases that pool); the worker binds the runtime in
        `register_caches` and owns it. The result workspace allocated here is the one every
        resolve rewrites (`CacheRuntime.result`)."""

    @abstractmethod
    def create_transfer_engine(self, host_pool: HostPool, runtimes: Sequence[CacheRuntime]) -> TransferEngine:
        """Build the engine that runs offload commands for these bound runtimes.

        Called once by `HiSparseWorker.register_caches`, after every runtime is bound, with the
        worker's pool and runtimes; the engine keeps references to them and frees neither. Raises
        `InvalidInputError` for a pool or runtime it cannot drive (released, unbound, or another
        backend's: reference_cpu's engine takes only its own runtimes)."""

    @classmethod
    def check_settings(cls) -> None:
        """Refuse a bad value of the backend's own settings before anything is allocated (optional).

        A backend read by environment variables of its own (tuning knobs, a cache directory) checks
        every one of them here. The registry calls it on the class, right after importing it and
        before constructing the backend (`select_backend`), and `hisparse_vllm.ops.register_ops`
        calls it through the registry when it registers vLLM's op set, where no backend is
        constructed; so it runs before any host pool, runtime, op registration, kernel compilation
        or model load, and a deployer's typo costs a fraction of a second instead of a pinned pool
        of hundreds of GiB or minutes of weight loading. The default does nothing: a backend with
        no settings of its own keeps it.

        What it must do: read each setting with the same parse function the backend uses when it
        builds what the setting tunes (one parse function a setting, so the check and the build
        cannot drift apart), and raise ONE `hisparse_core.errors.InvalidInputError` for the first
        bad value, in one line naming the variable, the bad value and what was expected
        (`"ACME_TILE='7' is not a tile size; expected 64, 128 or 256"`). Cross-variable rules that
        need no device belong here too (a switch that needs another). The registry passes that
        error on unchanged: it is the user's mistake, so the backend is not listed as broken and
        automatic selection does not fall back to another backend (the user fixes the variable).
        Any other exception is a bug of the backend: the registry lists it as broken and raises
        `BackendUnavailableError` naming `check_settings()`, as for a constructor that raises.

        What it must not do: allocate device or host memory, compile, load kernels, or initialise
        a device context or the device runtime (vLLM calls it in its front end, which forks the
        processes that use the GPU afterwards; `torch.cuda.is_available()` already poisons fork
        there). It is a classmethod for that reason: constructing a backend may touch the device.
        What it prints goes to stderr, as the constructor's does.

        A setting whose bound depends on the device or on a runtime's shape (`8 * num_sms`
        blocks) is checked here as far as it can be without them (an integer, at least 1) and
        checked again, against the exact bound, when the runtime is built.
        """
        return None  # nothing of its own to check

    def vllm_ops(self) -> VllmHiSparseOps:
        """The `VLLM_OPS` capability (optional): vLLM's HiSparse op set on this backend's device.

        Called once by `hisparse_vllm.ops.register_ops` when it registers the ops; the object
        serves every later call. A backend without the capability keeps this default, which raises.
        """
        from hisparse_core.errors import InvalidInputError

        if Capability.VLLM_OPS in self.capabilities:
            raise InvalidInputError(f"backend {self.name!r} declares {Capability.VLLM_OPS!r} but does not implement "
                                    "Backend.vllm_ops(); expected an override returning a "
                                    "hisparse_core.vllm_ops.VllmHiSparseOps (or drop the capability)")
        raise InvalidInputError(f"backend {self.name!r} does not declare {Capability.VLLM_OPS!r}")

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "version": self.version, "api_version": self.api_version,
                "capabilities": sorted(self.capabilities), "device": str(self.device)}


def capabilities_needed(config: RuntimeConfig) -> dict[str, str]:
    """The capabilities a runtime of `config` needs, each with the setting of `config` that needs it:
    its row format's where `Capability` names one (a model's own format, such as the transformers
    plugin's, has none), `SPECULATIVE_UNION` for several rows a request, `INDEX_SHARING` for several
    layers sharing one top-k."""
    need = {}
    fmt = f"row_format:{config.row_format.name}"
    if fmt in Capability.ALL:
        need[fmt] = f"row_format={config.row_format.name}"
    if config.rows_per_request > 1:
        need[Capability.SPECULATIVE_UNION] = f"rows_per_request={config.rows_per_request}"
    if config.num_layers > 1:
        need[Capability.INDEX_SHARING] = f"num_layers={config.num_layers} (layers sharing one top-k)"
    return need


def check_capabilities(backend: Backend, configs: Sequence[RuntimeConfig]) -> None:
    """Refuse, in one line and before anything is allocated, runtimes of `configs` that need a capability
    `backend` does not declare (`capabilities_needed`). The worker and the replay bench call it before
    the host pool; without it such a run failed wherever the backend first met the setting, mid-setup."""
    from hisparse_core.errors import InvalidInputError

    for config in configs:
        for cap, why in capabilities_needed(config).items():
            if cap not in backend.capabilities:
                raise InvalidInputError(
                    f"backend {backend.name!r} does not declare capability {cap!r}, which {why} needs; it "
                    f"declares {', '.join(sorted(backend.capabilities)) or 'none'}")


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """How a plugin describes a backend without importing it.

    - `name`: unique; what users pass to `--backend` / `HISPARSE_BACKEND`.
    - `factory`: "module:Class" of the `Backend` subclass, imported only on selection.
    - `probe`: cheap check that returns None when the backend can run here, else the reason
      ("no CUDA device", "cuda-python not installed: pip install 'hisparse[nvidia]'"). It must not
      raise; the registry turns an exception into an unavailable status with the error.
    - `priority`: automatic selection takes the highest available (reference_cpu is the lowest).
    - `capabilities`, `version`, `api_version`: shown by `hisparse backends`; `api_version` must
      equal `hisparse_core.API_VERSION`.
    """

    name: str
    factory: str
    probe: Callable[[], str | None]
    priority: int = 0
    capabilities: frozenset[str] = field(default_factory=frozenset)
    version: str = "0"
    api_version: int = API_VERSION
    description: str = ""
