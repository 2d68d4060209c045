"""Production-sized geometry (top_k=2048, hot_rows=4096, speculative pairs) against the list model."""

from __future__ import annotations

import torch
from refcpu_support import bound_runtime
from test_stateful import Model

from hisparse_core.geometry import RuntimeConfig
from hisparse_core.runtime import ResolveInputs


def test_large_batches_match_the_model() -> None:
    cfg = RuntimeConfig(max_batch_rows=8, max_requests=5, top_k=2048, hot_rows=4096, block_size=64,
                        max_pages=256, rows_per_request=2)
    gen = torch.Generator().manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    host_blocks, resident_blocks = 5 * 256, 32
    rt, host, dev = bound_runtime(cfg, host_blocks=host_blocks, device_blocks=resident_blocks + 5 * 64)
    model = Model(cfg)
    source = torch.randperm(host_blocks, generator=gen)[:5 * 256].view(5, 256).int()
    source[torch.rand(5, 256, generator=gen) < 0.05] = -1
    resident = torch.full((5, 256), -1, dtype=torch.int32)
    resident[:, -4:] = torch.randint(0, resident_blocks, (5, 4), generator=gen, dtype=torch.int32)
    hot = (resident_blocks + torch.randperm(5 * 64, generator=gen)).view(5, 64).int()
    row_state = torch.tensor([0, 0, 1, 2, 2, -1, 3, 4], dtype=torch.int32)
    seq_lens = torch.tensor([16384, 16384, 9000, 12000, 12000, 0, 16384, 5000], dtype=torch.int32)
    for step in range(3):
        # A drifting window plus random far positions and some masked entries.
        centre = (seq_lens.long() * (step + 1) // 4)[:, None]
        near = (centre + torch.randint(-1500, 1500, (8, 2048), generator=gen)).clamp(min=0)
        far = torch.randint(0, 1 << 20, (8, 2048), generator=gen) % seq_lens.long().clamp(min=1)[:, None]
        topk = torch.where(torch.rand(8, 2048, generator=gen) < 0.7, near, far)
        topk = torch.where(topk >= seq_lens.long()[:, None], -1, topk)
        topk[torch.rand(8, 2048, generator=gen) < 0.05] = -1
        topk = topk.int()
        res = rt.resolve(ResolveInputs(topk, row_state, seq_lens, source, resident, hot), validate=step != 1)
        model.resolve(topk.tolist(), row_state.tolist(), seq_lens.tolist(), source.tolist(), resident.tolist(),
                      hot.tolist())
        assert res.rows.tolist() == model.rows
        assert res.plan_counts.tolist() == [len(p) for p in model.plan]
        assert res.plan_host.tolist() == [[h for h, _ in p] + [-1] * (2048 - len(p)) for p in model.plan]
        assert res.plan_device.tolist() == [[d for _, d in p] + [-1] * (2048 - len(p)) for p in model.plan]
        for q in range(5):
            hot_map, lru = rt.hot_state(q)
            assert hot_map.tolist() == model.hot_map[q] and lru.tolist() == model.lru[q]
        flat, rows = dev[0].view(-1, 656), res.rows.long()
        for (b, i), g in list(model.sources.items())[::97]:
            assert torch.equal(flat[rows[b, i]], host[0][g])
    s = rt.stats()
    assert (s.resident, s.hits, s.misses) == tuple(model.counters[k] for k in ("resident", "hits", "misses"))
    assert s.hits > 0 and s.misses > 0 and s.resident > 0
