"""The host pool: layer views of the right geometry that keep what is written, a layer-major
private layout, idempotent release, and shared pools that peers see (docs/resolver-contract.md,
hisparse_core/host_pool.py)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import subprocess
import sys
import uuid

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hisparse_conformance.contract import must_raise
from hisparse_conformance.examples import examples
from hisparse_conformance.rig import usable_format
from hisparse_conformance.scenario import random_bytes
from hisparse_core.backend import Backend, Capability
from hisparse_core.discovery import import_factory
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import BF16_MLA, FP8_DS_MLA, RowFormat
from hisparse_core.host_pool import HostPoolSpec

FORMATS = [
    pytest.param(FP8_DS_MLA, marks=pytest.mark.requires_capability(Capability.FP8_DS_MLA), id="fp8_ds_mla"),
    pytest.param(BF16_MLA, marks=pytest.mark.requires_capability(Capability.BF16_MLA), id="bf16_mla"),
]

specs = st.builds(lambda layers, blocks, bs: (layers, blocks, bs), st.integers(1, 4), st.integers(1, 12),
                  st.sampled_from([1, 2, 16, 64]))


@pytest.mark.parametrize("fmt", FORMATS)
@examples(15)
@given(geometry=specs, seed=st.integers(0, 2**32 - 1))
def test_layer_views_keep_their_bytes(hisparse_backend: Backend, fmt: RowFormat,
                                      geometry: tuple[int, int, int], seed: int) -> None:
    layers, blocks, bs = geometry
    spec = HostPoolSpec(num_layers=layers, num_blocks=blocks, block_size=bs, row_format=fmt)
    with hisparse_backend.create_host_pool(spec) as pool:
        assert pool.spec == spec and pool.nbytes == spec.nbytes and pool.is_writer and not pool.released, (
            "a new private pool keeps its spec, has spec.nbytes bytes, is the writer and is not released")
        views = pool.layer_views()
        assert len(views) == layers, f"layer_views() returns one view per layer ({layers}), got {len(views)}"
        written = []
        for layer, view in enumerate(views):
            assert view.shape == (blocks * bs, fmt.width) and view.dtype == fmt.dtype, (
                f"layer_view({layer}) must be (num_blocks * block_size, row width) = {(blocks * bs, fmt.width)} of "
                f"{fmt.dtype}; got {tuple(view.shape)} of {view.dtype}")
            assert view.device.type == "cpu", f"layer {layer} view is on {view.device}; host rows live on the host"
            data = random_bytes((blocks * bs, fmt.row_bytes), seed, layer)
            view.view(torch.uint8).copy_(data)
            written.append(data)
        for layer in range(layers):  # every write landed in its own layer, and a new view sees it
            assert torch.equal(pool.layer_view(layer).view(torch.uint8).cpu(), written[layer]), (
                f"layer {layer}: bytes written through layer_views must read back unchanged through layer_view")


@pytest.mark.parametrize("fmt", FORMATS)
def test_private_pool_is_layer_major(hisparse_backend: Backend, fmt: RowFormat) -> None:
    """Host row g of layer l is at base + (l * rows + g) * row_bytes (HostPoolSpec's layout)."""
    spec = HostPoolSpec(num_layers=3, num_blocks=5, block_size=4, row_format=fmt)
    with hisparse_backend.create_host_pool(spec) as pool:
        base = pool.layer_view(0).data_ptr()
        for layer in range(spec.num_layers):
            view = pool.layer_view(layer)
            assert view.is_contiguous(), f"layer_view({layer}) of a private pool must be contiguous"
            assert view.data_ptr() - base == layer * spec.rows_per_layer * fmt.row_bytes, (
                f"a private pool is layer-major: layer {layer} starts at base + layer * rows_per_layer * row_bytes")


def test_release_is_idempotent_and_final(hisparse_backend: Backend) -> None:
    spec = HostPoolSpec(num_layers=2, num_blocks=3, block_size=2)
    pool = hisparse_backend.create_host_pool(spec)
    with must_raise(InvalidInputError, "layer_view(layer) rejects a layer >= num_layers"):
        pool.layer_view(2)
    with must_raise(InvalidInputError, "layer_view(layer) rejects a negative layer"):
        pool.layer_view(-1)
    pool.release()
    assert pool.released, "after release() the pool reports released"
    pool.release()
    assert pool.released, "release() is idempotent: a second call is a no-op and the pool stays released"
    with must_raise(InvalidInputError, "a released pool rejects layer_view (release is final)"):
        pool.layer_view(0)
    with hisparse_backend.create_host_pool(spec) as other:
        assert not other.released, "a pool used as a context manager is not released inside the block"
    assert other.released, "leaving the pool's with-block releases it"


def test_shared_pool_needs_the_capability(hisparse_backend: Backend) -> None:
    if Capability.SHARED_HOST_POOL in hisparse_backend.capabilities:
        pytest.skip(f"backend declares {Capability.SHARED_HOST_POOL}")
    spec = HostPoolSpec(num_layers=1, num_blocks=2, block_size=2, shared=True, name=f"conf-{uuid.uuid4().hex}")
    with must_raise(InvalidInputError, f"a backend that does not declare {Capability.SHARED_HOST_POOL} must reject "
                                       "create_host_pool(HostPoolSpec(shared=True)) with InvalidInputError"):
        hisparse_backend.create_host_pool(spec)


def _imports(factory: str) -> object:
    try:
        return import_factory(factory)
    except (ImportError, AttributeError):
        return None


def _peer_factory(backend: Backend) -> str:
    """What rank 1 imports: the registered factory where it names this class (a class a function made
    has a `__qualname__` no import finds), else the class's own `module:qualname`."""
    from hisparse_core.errors import BackendNotFoundError
    from hisparse_core.registry import get_registry

    cls = type(backend)
    candidates = [f"{cls.__module__}:{cls.__qualname__}"]
    with contextlib.suppress(BackendNotFoundError):
        candidates.insert(0, get_registry().spec(backend.name).factory)
    for factory in candidates:
        if _imports(factory) is cls:
            return factory
    tried = " nor ".join(repr(f) for f in candidates)
    pytest.fail(f"rank 1 of a shared pool runs in a child process that imports the backend class by 'module:Class', "
                f"and {'neither ' if len(candidates) > 1 else ''}{tried} {'names' if len(candidates) > 1 else 'does not name'} "
                f"{cls!r}; expected a class that an import finds (defined at module level, or registered under that "
                "name)", pytrace=False)


def _rank_one(backend: Backend, spec: HostPoolSpec, **extra: object) -> dict[str, object]:
    """Run `hisparse_conformance.peer` as rank 1 of `spec`'s shared pool; its JSON report."""
    factory = _peer_factory(backend)
    request = json.dumps({"factory": factory, "spec": {
        "num_layers": spec.num_layers, "num_blocks": spec.num_blocks, "block_size": spec.block_size,
        "row_format": spec.row_format.name, "name": spec.name, "world_size": 2, "rank": 1}, **extra})
    done = subprocess.run([sys.executable, "-m", "hisparse_conformance.peer", request], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, f"rank 1 failed:\n{done.stdout}\n{done.stderr}"
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def _digest(data: torch.Tensor) -> str:
    return hashlib.sha256(data.contiguous().numpy().tobytes()).hexdigest()


@pytest.mark.requires_capability(Capability.SHARED_HOST_POOL)
def test_shared_pool_peers_see_the_writers_bytes(hisparse_backend: Backend) -> None:
    """Rank 0 creates and writes a shared pool; rank 1, in another process as in tensor
    parallelism, maps it and reads the same bytes in every layer."""
    fmt = usable_format(hisparse_backend)
    seed = random.SystemRandom().randrange(2**32)
    spec = HostPoolSpec(num_layers=2, num_blocks=3, block_size=4, row_format=fmt, shared=True,
                        name=f"hisparse-conformance-{os.getpid()}-{uuid.uuid4().hex[:12]}", world_size=2)
    with hisparse_backend.create_host_pool(spec) as writer:
        assert writer.is_writer, "rank 0 of a shared pool (the creator) is its writer"
        digests = []
        for layer in range(spec.num_layers):
            data = random_bytes((spec.rows_per_layer, fmt.row_bytes), seed, layer)
            writer.layer_view(layer).view(torch.uint8).copy_(data)
            digests.append(_digest(data))
        report = _rank_one(hisparse_backend, spec)
        assert report == {"is_writer": False, "digests": digests}, (
            "rank 1 of a shared pool maps the writer's pool (is_writer False) and reads the same bytes in every layer")


@pytest.mark.requires_capability(Capability.SHARED_HOST_POOL)
def test_a_reader_rank_restores_pages_into_its_own_device(hisparse_backend: Backend) -> None:
    """Only the writer rank writes a shared pool, but restores are host-to-device: rank 1's transfer
    engine must copy every restored page into its own device caches (a tensor-parallel rank that
    skipped them would attend over stale rows), leave the pool's bytes alone, and acknowledge each
    transfer id once, enqueued and completed, by its drain."""
    fmt = usable_format(hisparse_backend)
    rng = random.Random(random.SystemRandom().randrange(2**32))
    spec = HostPoolSpec(num_layers=2, num_blocks=6, block_size=4, row_format=fmt, shared=True,
                        name=f"hisparse-conformance-{os.getpid()}-{uuid.uuid4().hex[:12]}", world_size=2)
    device_blocks = 5
    count = rng.randint(1, 3)
    hosts, devices = rng.sample(range(spec.num_blocks), count), rng.sample(range(device_blocks), count)
    ids = sorted(rng.sample(range(1000), count))
    restores = [[ids[i], hosts[i], devices[i]] for i in range(count)]
    bs = spec.block_size
    with hisparse_backend.create_host_pool(spec) as writer:
        layers = [random_bytes((spec.rows_per_layer, fmt.row_bytes), rng.randrange(2**32), layer)
                  for layer in range(spec.num_layers)]
        for layer, data in enumerate(layers):
            writer.layer_view(layer).view(torch.uint8).copy_(data)
        report = _rank_one(hisparse_backend, spec, restores=restores, device_blocks=device_blocks)
    digests = [_digest(data) for data in layers]
    restored = [[_digest(data[host * bs:(host + 1) * bs]) for _, host, _ in restores] for data in layers]
    assert report["is_writer"] is False and report["digests"] == digests, "rank 1 maps the writer's bytes"
    assert report["restored"] == restored, (
        f"rank 1's restores {restores} ([id, host block, device block]) must land in its own device caches, "
        "every layer, byte for byte")
    assert report["after"] == digests, "a restore on rank 1 must not change the shared pool"
    assert report["enqueued"] == ids and report["completed"] == ids, (
        f"rank 1's drain() must report every restore id enqueued and completed: {ids}, got {report}")
