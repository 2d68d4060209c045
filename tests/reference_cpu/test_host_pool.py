"""The reference host pool: private and /dev/shm-shared modes, across processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from refcpu_support import random_rows

from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import BF16_MLA, FP8_DS_MLA, RowFormat
from hisparse_core.host_pool import HostPoolSpec
from hisparse_reference_cpu.host_pool import ReferenceHostPool, shm_path

FORMATS = st.sampled_from([FP8_DS_MLA, BF16_MLA])


def unique_name() -> str:
    return f"test_{os.getpid()}_{uuid.uuid4().hex[:12]}"


@settings(max_examples=20, deadline=None)
@given(layers=st.integers(1, 4), blocks=st.integers(1, 6), bs=st.integers(1, 8), fmt=FORMATS,
       shared=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_layer_views_are_disjoint_layer_major_views(layers: int, blocks: int, bs: int, fmt: RowFormat,
                                                     shared: bool, seed: int) -> None:
    spec = HostPoolSpec(num_layers=layers, num_blocks=blocks, block_size=bs, row_format=fmt, shared=shared,
                        name=unique_name() if shared else None)
    with ReferenceHostPool(spec) as pool:
        assert pool.is_writer and not pool.released
        views = pool.layer_views()
        gen = torch.Generator().manual_seed(seed)
        data = [random_rows((blocks * bs, fmt.width), fmt, gen) for _ in range(layers)]
        for view, d in zip(views, data, strict=False):
            assert view.shape == (blocks * bs, fmt.width) and view.dtype == fmt.dtype and view.is_contiguous()
            view.copy_(d)
        for layer, d in enumerate(data):
            assert torch.equal(pool.layer_view(layer).view(torch.uint8), d.view(torch.uint8))
        # Layer-major: layer l starts l * rows_per_layer rows after layer 0.
        row_bytes = fmt.row_bytes
        for layer, view in enumerate(views):
            assert view.data_ptr() - views[0].data_ptr() == layer * spec.rows_per_layer * row_bytes
        path = pool.path
        assert (path is not None) == shared
    assert pool.released
    if shared:
        assert path is not None and not os.path.exists(path)
    pool.release()  # idempotent


def test_released_pool_and_bad_layers_raise() -> None:
    pool = ReferenceHostPool(HostPoolSpec(num_layers=2, num_blocks=2, block_size=4))
    with pytest.raises(InvalidInputError, match="layer 2"):
        pool.layer_view(2)
    pool.release()
    with pytest.raises(InvalidInputError, match="released"):
        pool.layer_view(0)


def test_bad_names_are_rejected() -> None:
    for name in ("../etc", "a/b", "x" * 200, ""):
        with pytest.raises(InvalidInputError):
            shm_path(name)


def _peer(name: str, spec_kwargs: dict, seed: int, ready: mp.Event, done: mp.Event, out: mp.Queue) -> None:
    try:
        spec = HostPoolSpec(shared=True, name=name, rank=1, world_size=2, **spec_kwargs)
        pool = ReferenceHostPool(spec, peer_timeout_s=20)
        assert not pool.is_writer
        ready.wait(20)
        fmt = spec.row_format
        gen = torch.Generator().manual_seed(seed)
        ok = all(torch.equal(pool.layer_view(l).view(torch.uint8),
                             random_rows((spec.rows_per_layer, fmt.width), fmt, gen).view(torch.uint8))
                 for l in range(spec.num_layers))
        pool.release()
        out.put(("ok", ok))
    except BaseException as exc:  # report, don't hang the parent
        out.put(("error", repr(exc)))
    finally:
        done.set()


@pytest.mark.parametrize("fmt", [FP8_DS_MLA, BF16_MLA], ids=lambda f: f.name)
def test_two_processes_share_the_pool(fmt: RowFormat) -> None:
    ctx = mp.get_context("fork")
    name = unique_name()
    kwargs = dict(num_layers=3, num_blocks=5, block_size=4, row_format=fmt)
    seed = int.from_bytes(os.urandom(4), "little")
    ready, done, out = ctx.Event(), ctx.Event(), ctx.Queue()
    # The peer starts first and must wait for rank 0 to publish the file.
    peer = ctx.Process(target=_peer, args=(name, kwargs, seed, ready, done, out))
    peer.start()
    try:
        pool = ReferenceHostPool(HostPoolSpec(shared=True, name=name, rank=0, world_size=2, **kwargs))
        gen = torch.Generator().manual_seed(seed)
        for layer in range(3):
            pool.layer_view(layer).copy_(random_rows((20, fmt.width), fmt, gen))
        ready.set()
        assert done.wait(30)
        assert out.get(timeout=5) == ("ok", True)
        # Both ranks mapped the file, so its name is gone: nothing can leak from here on.
        assert pool.path == shm_path(name) and not os.path.exists(shm_path(name))
        pool.release()
    finally:
        peer.join(10)
        if peer.is_alive():
            peer.kill()


def test_a_one_rank_shared_pool_never_has_a_file() -> None:
    spec = HostPoolSpec(num_layers=1, num_blocks=2, block_size=4, shared=True, name=unique_name())
    with ReferenceHostPool(spec) as pool:
        assert not os.path.exists(shm_path(spec.name or "")) and pool.layer_view(0).shape == (8, FP8_DS_MLA.width)


def test_live_name_clash_and_geometry_mismatch_are_rejected() -> None:
    name = unique_name()
    spec = HostPoolSpec(num_layers=2, num_blocks=2, block_size=4, shared=True, name=name, world_size=2)
    with ReferenceHostPool(spec):
        ctx = mp.get_context("fork")
        out = ctx.Queue()

        def other_creator() -> None:
            try:
                ReferenceHostPool(spec)
                out.put("created")
            except InvalidInputError as exc:
                out.put(str(exc))

        p = ctx.Process(target=other_creator)
        p.start()
        p.join(20)
        assert "in use by live process" in out.get(timeout=5)
        with pytest.raises(InvalidInputError, match="with world_size=2 layers=2 .*expected world_size=2 layers=3"):
            ReferenceHostPool(HostPoolSpec(num_layers=3, num_blocks=2, block_size=4, shared=True, name=name,
                                           rank=1, world_size=2), peer_timeout_s=30)
    assert not os.path.exists(shm_path(name))
