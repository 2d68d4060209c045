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
    selected, and only after its probe said it can run here. Construction must be cheap and must
    not allocate device memory; allocation happens in the factories. One instance serves one
    worker process.
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
