"""The NVIDIA runtime against the CPU reference, bit for bit, on random engine-like steps.

Every call is made on both runtimes with identical inputs; after each one the outputs, the miss
plan, every state row's hot map and LRU order, the counters and every device and host byte must
be equal. Needs a CUDA GPU (skipped otherwise).
"""

from __future__ import annotations

import random

import pytest
import torch
from nvidia_support import Tables, Twin, random_step, random_tables, requires_gpu

from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import BF16_MLA, FP8_DS_MLA, RuntimeConfig
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror

pytestmark = [requires_gpu, pytest.mark.gpu]


def _small_config(rng: random.Random) -> tuple[RuntimeConfig, int, int]:
    bs = rng.choice([1, 2, 4, 8])
    k = rng.randint(1, 40)
    rpr = rng.randint(1, 3)
    hot_blocks = -(-rpr * k // bs) + rng.randint(0, 2)
    r = rng.randint(1, 4)
    p = rng.randint(1, 12)
    cfg = RuntimeConfig(max_batch_rows=r * rpr + rng.randint(0, 2), max_requests=r, top_k=k,
                        hot_rows=hot_blocks * bs, block_size=bs, max_pages=p, num_layers=rng.randint(1, 3),
                        rows_per_request=rpr, row_format=rng.choice([FP8_DS_MLA, BF16_MLA]))
    return cfg, r * p + 2, r * hot_blocks + r * p + 2


def _maintenance(twin: Twin, rng: random.Random) -> None:
    cfg = twin.cfg
    bs = cfg.block_size
    assert twin.tables is not None
    src = twin.tables.source
    if rng.random() < 0.4:
        pairs = []
        for _ in range(rng.randint(1, 4)):
            q = rng.randrange(cfg.max_requests)
            blocks = [b for b in src[q].tolist() if b >= 0]
            if blocks:
                pairs.append((q, rng.choice(blocks) * bs + rng.randrange(bs)))
        pairs.append((-1, 0))
        s = torch.tensor([q for q, _ in pairs], dtype=torch.int32)
        g = torch.tensor([x for _, x in pairs], dtype=torch.int32)
        twin.rt.invalidate_written_slots(s.to(twin.dev), g.to(twin.dev))
        twin.ref.invalidate_written_slots(s, g)
    if rng.random() < 0.3:
        blocks = sorted({b for b in src.flatten().tolist() if b >= 0})
        chosen = rng.sample(blocks, min(len(blocks), rng.randint(1, 3)))
        twin.rt.invalidate_host_blocks(chosen)
        twin.ref.invalidate_host_blocks(chosen)
    if rng.random() < 0.2:
        rows = rng.sample(range(cfg.max_requests), 1)
        twin.rt.reset_state(rows)
        twin.ref.reset_state(rows)


def _drifting_steps(twin: Twin, tables: Tables, rng: random.Random, what: str, localities: list[float]) -> None:
    """12 compared steps; after each, maintenance, and now and then a page of one request remapped
    to another page's host block (possibly another request's)."""
    cfg = twin.cfg
    twin.set_tables(tables)
    previous: dict = {}
    for i in range(12):
        step = random_step(cfg, rng, previous, locality=rng.choice(localities), mask_share=0.05, padding_share=0.2)
        twin.resolve(step, validate=rng.random() < 0.5)
        if cfg.num_layers > 1:
            twin.rt.replay_plan()
            twin.ref.replay_plan()
        twin.compare_all(f"{what} step {i}")
        _maintenance(twin, rng)
        if rng.random() < 0.3:
            source = tables.source.clone()
            q = rng.randrange(cfg.max_requests)
            p = cfg.max_pages
            source[q, rng.randrange(p)] = source[rng.randrange(cfg.max_requests), rng.randrange(p)]
            tables.source = source
            twin.set_tables(tables)


@pytest.mark.parametrize("seed", range(24))
def test_small_geometries_match_reference(seed: int) -> None:
    rng = random.Random(seed)
    cfg, host_blocks, dev_blocks = _small_config(rng)
    twin = Twin(cfg, host_blocks=host_blocks, num_device_blocks=dev_blocks, seed=seed)
    try:
        tables = random_tables(cfg, host_blocks, dev_blocks, rng, resident_share=rng.choice([0, 0.3, 0.7]),
                               null_share=rng.choice([0, 0.15]))
        twin.set_tables(tables)
        previous: dict = {}
        for i in range(10):
            step = random_step(cfg, rng, previous, locality=rng.choice([0.0, 0.5, 0.9, 1.0]),
                               mask_share=rng.choice([0, 0.1]), padding_share=0.25)
            twin.resolve(step, validate=rng.random() < 0.5)
            if cfg.num_layers > 1 and rng.random() < 0.7:
                twin.rt.replay_plan()
                twin.ref.replay_plan()
            twin.compare_all(f"seed {seed} step {i}")
            _maintenance(twin, rng)
            twin.compare_state(f"seed {seed} maintenance after step {i}")
    finally:
        twin.close()


@pytest.mark.parametrize("seed", range(8))
def test_remapped_and_shared_host_blocks_match_reference(seed: int) -> None:
    """Pages change host blocks between steps, and pages of one request share a host block.

    The contract hits by host row, whatever position loaded it: a row held in a slot filled for
    another position is still a hit and never loaded twice. The resolver's position hints are wrong
    exactly then, so this checks its exact slow path against the reference."""
    rng = random.Random(1000 + seed)
    cfg, host_blocks, dev_blocks = _small_config(rng)
    twin = Twin(cfg, host_blocks=host_blocks, num_device_blocks=dev_blocks, seed=seed)
    try:
        tables = random_tables(cfg, host_blocks, dev_blocks, rng, resident_share=rng.choice([0, 0.3]),
                               null_share=0.0)
        twin.set_tables(tables)
        previous: dict = {}
        for i in range(12):
            step = random_step(cfg, rng, previous, locality=rng.choice([0.5, 0.9, 1.0]), mask_share=0.05,
                               padding_share=0.1)
            twin.resolve(step, validate=rng.random() < 0.5)
            twin.compare_all(f"seed {seed} step {i}")
            source = tables.source.clone()
            for q in range(cfg.max_requests):
                for _ in range(rng.randint(0, 3)):  # take the host block of another page, often this request's
                    q2 = q if rng.random() < 0.6 else rng.randrange(cfg.max_requests)
                    source[q, rng.randrange(cfg.max_pages)] = source[q2, rng.randrange(cfg.max_pages)]
            tables.source = source
            twin.set_tables(tables)
        assert twin.rt.stats().hits > 0
    finally:
        twin.close()


@pytest.mark.parametrize("seed", range(15))
def test_speculative_gather_matches_reference(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small batches with top_k a multiple of 32: the copy after each resolve reads likely misses
    while the resolver runs, then writes the resolver's misses. Maintenance, remapped pages and
    pages sharing host blocks make its guesses wrong in both directions; the bytes must not care.
    Seeds 1 mod 3 run the same steps with the speculative gather turned off; seeds 2 mod 3 let it
    cover only the first batch row, so that a larger batch is split: the speculative gather for
    row 0 and the plan copy, following the resolver, for the rows after it (groups may straddle)."""
    mode = seed % 3
    if seed >= 9:  # the slot kernel (HISPARSE_SPEC_KERNEL=slots) on the same kinds of steps
        monkeypatch.setenv("HISPARSE_SPEC_KERNEL", "slots")
    if mode == 1:
        monkeypatch.setenv("HISPARSE_SPEC_GATHER", "0")
    if mode == 2:
        monkeypatch.setenv("HISPARSE_SPEC_ROWS", "1")
    rng = random.Random(3000 + seed)
    bs = rng.choice([1, 4, 16])
    k = rng.choice([32, 64, 96])
    rpr = rng.randint(1, 2)
    r = rng.randint(2, 4) if mode == 2 else rng.randint(1, 3)
    p = rng.randint(2, 12) * max(1, 32 // bs)
    hot_blocks = -(-rpr * k // bs) + rng.randint(0, 3)
    cfg = RuntimeConfig(max_batch_rows=r * rpr, max_requests=r, top_k=k, hot_rows=hot_blocks * bs, block_size=bs,
                        max_pages=p, num_layers=rng.randint(1, 2), rows_per_request=rpr,
                        row_format=rng.choice([FP8_DS_MLA, BF16_MLA]))
    host_blocks, dev_blocks = r * p + 2, r * hot_blocks + r * p + 2
    twin = Twin(cfg, host_blocks=host_blocks, num_device_blocks=dev_blocks, seed=seed)
    try:
        spec, split = twin.rt.launch_shape["spec_max_batch"], twin.rt.launch_shape["spec_split"]
        assert (spec >= cfg.max_batch_rows, spec, split) == ((True, spec, True), (False, 0, False), (False, 1, True))[mode]
        tables = random_tables(cfg, host_blocks, dev_blocks, rng, resident_share=rng.choice([0, 0.3]),
                               null_share=rng.choice([0, 0.1]))
        _drifting_steps(twin, tables, rng, f"seed {seed}", [0.5, 0.8, 1.0])
        assert twin.rt.stats().misses > 0
    finally:
        twin.close()


@pytest.mark.parametrize("seed", range(12))
def test_speculative_gather_early_exit_matches_reference(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of hint hits, resident steps and steps with a few misses, one after the other, on
    batches the speculative gather covers: blocks that can hold no miss leave without waiting for
    the resolver (the victims flag, copy.cu), the rest copy the resolver's misses. Odd seeds turn
    the early exit off (HISPARSE_SPEC_EARLY_EXIT=0), seeds 2 and 3 mod 4 run the slot kernel
    (HISPARSE_SPEC_KERNEL=slots), seeds 4 and 8 entry blocks of 8 and 37 entries (37: runs of one
    entry), seeds 5 and 9 runs of one entry and consecutive entries a block (HISPARSE_SPEC_RUN=1, 0);
    the bytes must be the reference's in every case."""
    if seed % 2:
        monkeypatch.setenv("HISPARSE_SPEC_EARLY_EXIT", "0")
    kernel = "slots" if seed % 4 >= 2 else "entries"
    monkeypatch.setenv("HISPARSE_SPEC_KERNEL", kernel)
    if seed in (4, 8):  # entry blocks of a few entries: many partial blocks
        monkeypatch.setenv("HISPARSE_SPEC_EPB", str((8, 37)[seed // 8]))
    if seed in (5, 9):  # a block's entries every nb-th of the row, or all consecutive
        monkeypatch.setenv("HISPARSE_SPEC_RUN", str((1, 0)[seed // 8]))
    rng = random.Random(9100 + seed)
    bs = rng.choice([4, 16])
    k = rng.choice([64, 256])
    r = rng.randint(2, 8)
    p = 4 * k // bs
    hot_blocks = 2 * k // bs
    cfg = RuntimeConfig(max_batch_rows=r, max_requests=r, top_k=k, hot_rows=hot_blocks * bs, block_size=bs,
                        max_pages=p, rows_per_request=1, row_format=rng.choice([FP8_DS_MLA, BF16_MLA]))
    host_blocks, dev_blocks = r * p + 2, r * hot_blocks + r * p + 2
    twin = Twin(cfg, host_blocks=host_blocks, num_device_blocks=dev_blocks, seed=seed)
    try:
        shape = twin.rt.launch_shape
        assert shape["spec_max_batch"] >= r and shape["spec_early_exit"] == (seed % 2 == 0)
        assert shape["spec_kernel"] == kernel
        tables = random_tables(cfg, host_blocks, dev_blocks, rng, resident_share=rng.choice([0, 0.5]), null_share=0)
        twin.set_tables(tables)
        previous: dict = {}
        for i in range(16):
            locality = (1.0, 1.0, 0.98, 1.0, 0.9)[i % 5]
            step = random_step(cfg, rng, previous, locality=locality, mask_share=0.02, padding_share=0.1)
            twin.resolve(step, validate=False)
            twin.compare_all(f"seed {seed} step {i} (locality {locality})")
        stats = twin.rt.stats()
        assert stats.hits > 0 and stats.misses > 0
    finally:
        twin.close()


@pytest.mark.parametrize("seed", range(6))
def test_plan_copy_per_sm_limit_and_trace(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan copy after every resolve, half of the steps traced (`plan_copy_trace`): the bytes
    must not care, and the trace must account for every 16 KB chunk of the plan exactly once, on
    real SMs. Seeds 0 and 1 mod 3 limit its blocks per SM (`HISPARSE_GATHER_PER_SM` 1 and 2) with a
    grid of 8 blocks per SM, too many to start beside any resolver, so that every copy is padded;
    seeds 2 mod 3 run the defaults (small batches leave enough free SMs: no padding)."""
    per_sm = ("1", "2", None)[seed % 3]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if per_sm is not None:
        monkeypatch.setenv("HISPARSE_GATHER_PER_SM", per_sm)
        monkeypatch.setenv("HISPARSE_GATHER_BLOCKS", str(8 * sms))
    monkeypatch.setenv("HISPARSE_SPEC_GATHER", "0")  # every miss goes through the plan copy
    rng = random.Random(7000 + seed)
    cfg, host_blocks, dev_blocks = _small_config(rng)
    twin = Twin(cfg, host_blocks=host_blocks, num_device_blocks=dev_blocks, seed=seed)
    try:
        shape = twin.rt.launch_shape
        if per_sm is not None:
            assert shape["plan_copy_padded_per_sm"] == int(per_sm) and shape["plan_copy_pad_smem"] > 0, shape
            assert twin.rt._copy_choice(cfg.max_batch_rows, True, sms - cfg.max_batch_rows)[3]
        chunk, slots = shape["copy_threads"] * shape["copy_unroll"], twin.rt._copy_shape.slots_per_row
        twin.set_tables(random_tables(cfg, host_blocks, dev_blocks, rng, resident_share=0.1, null_share=0.05))
        previous: dict = {}
        traced = 0
        for i in range(10):
            # Traced steps mostly bring new positions, so that their plans have misses.
            step = random_step(cfg, rng, previous, locality=0.8 if i % 2 else 0.1, mask_share=0.05,
                               padding_share=0.2)
            if i % 2:
                twin.resolve(step)
            else:
                trace = twin.rt.plan_copy_trace(twin.inputs(step, device=True))
                twin.ref.resolve(twin.inputs(step, device=False), gather=True, validate=False)
                total = int(twin.ref.result.plan_counts[:len(step.topk)].clamp(0, cfg.top_k).sum()) * slots
                assert len(trace) == shape["gather_blocks"], f"step {i}"
                assert all(0 <= sm < sms for sm, *_ in trace), f"step {i}: {trace}"
                assert sum(r[1] for r in trace) == -(-total // chunk), f"step {i}: {trace}"
                assert all(r[4] >= r[2] >= 0 for r in trace) and all(r[3] >= r[2] for r in trace if r[1]), trace
                traced += total > 0
            twin.compare_all(f"seed {seed} step {i}")
        assert traced > 0 and twin.rt.stats().misses > 0
    finally:
        twin.close()


@pytest.mark.parametrize("seed", range(12))
def test_cluster_resolver_matches_reference(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread-block-cluster resolver (2, 4 or 8 blocks per group, the helpers gathering shares
    of the position hints) on random small geometries with maintenance and remapped pages: its
    hints are wrong as often as the one-block build's, and the results must not differ. Up to 12
    output rows past the batch, which the helpers write as padding when the batch shrinks."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90 or newer")
    width = (2, 4, 8)[seed % 3]
    monkeypatch.setenv("HISPARSE_RESOLVE_CLUSTER", str(width))
    rng = random.Random(5000 + seed)
    bs = rng.choice([1, 4, 8])
    rpr = rng.randint(1, 3)
    k = 8 * width * rng.randint(1, 3)
    r = rng.randint(1, 3)
    p = rng.randint(2, 10) * max(1, 16 // bs)
    hot_blocks = -(-rpr * k // bs) + rng.randint(0, 3)
    cfg = RuntimeConfig(max_batch_rows=r * rpr + rng.randint(0, 12), max_requests=r, top_k=k,
                        hot_rows=hot_blocks * bs, block_size=bs, max_pages=p, num_layers=rng.randint(1, 2),
                        rows_per_request=rpr, row_format=rng.choice([FP8_DS_MLA, BF16_MLA]))
    host_blocks, dev_blocks = r * p + 2, r * hot_blocks + r * p + 2
    twin = Twin(cfg, host_blocks=host_blocks, num_device_blocks=dev_blocks, seed=seed)
    try:
        assert twin.rt._cluster == width
        tables = random_tables(cfg, host_blocks, dev_blocks, rng, resident_share=rng.choice([0, 0.3, 0.7]),
                               null_share=rng.choice([0, 0.1]))
        _drifting_steps(twin, tables, rng, f"seed {seed}", [0.5, 0.9, 1.0])
        assert twin.rt.stats().hits > 0
    finally:
        twin.close()


@pytest.mark.parametrize(("rows_per_request", "smem", "cluster", "spec_rows"),
                         [(1, None, None, None), (2, None, None, None), (1, "0", None, None), (1, None, "1", None),
                          (1, None, "4", None), (1, None, None, "2"), (2, None, None, "3")])
def test_production_geometry_matches_reference(rows_per_request: int, smem: str | None, cluster: str | None,
                                               spec_rows: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """top-k 2048, 4096 hot rows per request (8192 with a speculative row), 656-byte rows, 32K contexts.

    `smem` "0" leaves the resolver no shared memory for the page tables (gathered per entry);
    `cluster` sets the resolver's blocks per group (default: the cluster build at this batch);
    `spec_rows` caps the rows the speculative gather covers, so that larger batches are split
    between it and the plan copy."""
    if spec_rows is not None:
        monkeypatch.setenv("HISPARSE_SPEC_ROWS", spec_rows)
    if smem is not None:
        monkeypatch.setenv("HISPARSE_RESOLVE_SMEM", smem)
    if cluster is not None:
        if cluster != "1" and torch.cuda.get_device_capability()[0] < 9:
            pytest.skip("thread-block clusters need sm_90 or newer")
        monkeypatch.setenv("HISPARSE_RESOLVE_CLUSTER", cluster)
    rng = random.Random(100 + rows_per_request)
    cfg = RuntimeConfig(max_batch_rows=6, max_requests=4, top_k=2048, hot_rows=4096 * rows_per_request,
                        block_size=64, max_pages=512, num_layers=2, rows_per_request=rows_per_request)
    host_blocks = cfg.max_requests * cfg.max_pages
    dev_blocks = cfg.max_requests * cfg.hot_blocks + 1024
    twin = Twin(cfg, host_blocks=host_blocks, num_device_blocks=dev_blocks, seed=rows_per_request)
    try:
        if smem is not None:  # the limit reached the build
            assert not twin.rt.launch_shape["tables_in_smem"], twin.rt.launch_shape
        if cluster is not None:  # so did the blocks per group, for every batch of this runtime
            shape = twin.rt.launch_shape
            assert shape["cluster_blocks"] == int(cluster), shape
            assert cluster == "1" or shape["cluster_max_batch"] >= cfg.max_batch_rows, shape
        if spec_rows is not None:
            assert twin.rt.launch_shape["spec_max_batch"] == int(spec_rows) and twin.rt.launch_shape["spec_split"]
        twin.set_tables(random_tables(cfg, host_blocks, dev_blocks, rng, resident_share=0.05, null_share=0.01))
        previous: dict = {}
        for i in range(8):
            step = random_step(cfg, rng, previous, locality=0.87, mask_share=0.01, padding_share=0.2)
            twin.resolve(step)
            twin.rt.replay_plan()
            twin.ref.replay_plan()
            twin.compare_all(f"step {i}")
        assert twin.rt.stats().misses > 0 and twin.rt.stats().hits > 0
    finally:
        twin.close()


def test_resident_fast_path_leaves_lru_untouched() -> None:
    rng = random.Random(7)
    cfg = RuntimeConfig(max_batch_rows=2, max_requests=2, top_k=64, hot_rows=128, block_size=16, max_pages=8)
    twin = Twin(cfg, host_blocks=16, num_device_blocks=40, seed=7)
    try:
        tables = random_tables(cfg, 16, 40, rng, resident_share=0.0, null_share=0.0)
        twin.set_tables(tables)
        step = random_step(cfg, rng, {}, locality=0.0, padding_share=0.0, requests=[0])
        twin.resolve(step)  # fill the hot buffer of state row 0
        before = twin.rt.hot_state(0)
        resident = tables.resident.clone()
        resident[0] = torch.arange(cfg.max_pages, dtype=torch.int32) + 16  # every page resident
        tables.resident = resident
        twin.set_tables(tables)
        twin.resolve(step)
        after = twin.rt.hot_state(0)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
        assert int(twin.rt.result.plan_counts.sum()) == 0
        twin.compare_all("resident")
    finally:
        twin.close()


def test_validation_rejects_and_changes_nothing() -> None:
    rng = random.Random(3)
    cfg = RuntimeConfig(max_batch_rows=3, max_requests=2, top_k=8, hot_rows=16, block_size=4, max_pages=4)
    twin = Twin(cfg, host_blocks=10, num_device_blocks=20, seed=3)
    try:
        twin.set_tables(random_tables(cfg, 10, 20, rng, resident_share=0.2, null_share=0.0))
        step = random_step(cfg, rng, {}, locality=0.0, padding_share=0.0, requests=[0, 1])
        twin.resolve(step)
        snapshot = [twin.rt.hot_state(q) for q in range(2)], twin.rt.stats()
        bad = step.topk.clone()
        bad[0, 0] = 10_000
        with pytest.raises(InvalidInputError, match="topk"):
            twin.rt.resolve(twin.inputs(type(step)(bad, step.row_state, step.seq_lens), device=True))
        with pytest.raises(InvalidInputError, match="row_state"):
            twin.rt.resolve(twin.inputs(type(step)(step.topk, step.row_state * 0 + 5, step.seq_lens), device=True))
        with pytest.raises(InvalidInputError, match="dtype"):
            twin.rt.resolve(twin.inputs(type(step)(step.topk.long(), step.row_state, step.seq_lens), device=True))
        with pytest.raises(InvalidInputError, match="is on"):
            twin.rt.resolve(twin.inputs(step, device=False))
        after = [twin.rt.hot_state(q) for q in range(2)], twin.rt.stats()
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(snapshot[0], after[0], strict=False))
        assert snapshot[1] == after[1]
    finally:
        twin.close()


def test_out_of_context_positions_are_masked_without_validation() -> None:
    rng = random.Random(4)
    cfg = RuntimeConfig(max_batch_rows=2, max_requests=2, top_k=8, hot_rows=16, block_size=4, max_pages=4)
    twin = Twin(cfg, host_blocks=10, num_device_blocks=20, seed=4)
    try:
        twin.set_tables(random_tables(cfg, 10, 20, rng, resident_share=0.3, null_share=0.0))
        step = random_step(cfg, rng, {}, locality=0.0, padding_share=0.0, requests=[0, 1])
        step.topk[0, :3] = torch.tensor([-7, 15, 10_000], dtype=torch.int32)
        twin.resolve(step, validate=False)
        twin.compare_all("masked")
    finally:
        twin.close()


@pytest.mark.parametrize("fmt", [FP8_DS_MLA, BF16_MLA])
def test_mirror_spill_restore_and_host_copies(fmt) -> None:  # noqa: ANN001
    random.Random(11)
    cfg = RuntimeConfig(max_batch_rows=2, max_requests=2, top_k=16, hot_rows=32, block_size=8, max_pages=6,
                        num_layers=3, row_format=fmt)
    twin = Twin(cfg, host_blocks=14, num_device_blocks=30, seed=11)
    try:
        mirrors = [RowMirror((8 * 3 + 2,), 8 * 5 + 2, 4), RowMirror((8 * 7,), 8 * 1, 8)]
        spills = [PageTransfer(1, 9, (12,)), PageTransfer(2, 3, (4,))]
        restores = [PageTransfer(3, 6, (20,), restore=True)]
        copies = [HostBlockCopy(9, 11), HostBlockCopy(2, 13)]
        for rt in (twin.rt, twin.ref):
            rt.mirror_rows(mirrors)
            rt.spill_pages(spills)
            rt.restore_pages(restores)
            rt.copy_host_blocks(copies)
        twin.compare_bytes("copies")
        assert twin.rt.stats() == twin.ref.stats()
        with pytest.raises(InvalidInputError, match="block boundary"):
            twin.rt.mirror_rows([RowMirror((6,), 0, 4)])
        with pytest.raises(InvalidInputError, match="restore"):
            twin.rt.spill_pages(restores)
    finally:
        twin.close()


def test_strided_device_blocks() -> None:
    """Device caches that are views of a packed slab (block stride larger than one block)."""
    cfg = RuntimeConfig(max_batch_rows=1, max_requests=1, top_k=32, hot_rows=64, block_size=16, max_pages=8)
    from hisparse_core.host_pool import HostPoolSpec
    from hisparse_core.runtime import ResolveInputs
    from hisparse_nvidia.backend import NvidiaBackend

    be = NvidiaBackend()
    dev = be.device
    pool = be.create_host_pool(HostPoolSpec(num_layers=1, num_blocks=8, block_size=16))
    try:
        host = pool.layer_view(0)
        host.view(torch.uint8).copy_(torch.randint(0, 256, (128, 656), dtype=torch.uint8))
        slab = torch.zeros((12, 2, 16, 656), dtype=torch.uint8, device=dev)  # two "layers" per block
        cache = slab[:, 1]
        rt = be.create_runtime(cfg)
        rt.bind([host], [cache])
        i32 = torch.int32
        inputs = ResolveInputs(torch.arange(32, dtype=i32, device=dev)[None] * 4, torch.zeros(1, dtype=i32, device=dev),
                               torch.full((1,), 128, dtype=i32, device=dev),
                               torch.arange(8, dtype=i32, device=dev)[None], torch.full((1, 8), -1, dtype=i32, device=dev),
                               torch.tensor([[10, 3, 7, 1]], dtype=i32, device=dev))
        out = rt.resolve(inputs)
        rows = out.rows[0].long()
        got = cache.reshape(-1, 656)[rows].cpu()
        want = host[torch.arange(32) * 4]
        assert torch.equal(got, want)
        assert int(slab[:, 0].count_nonzero()) == 0  # the neighbouring layer is untouched
    finally:
        pool.release()
