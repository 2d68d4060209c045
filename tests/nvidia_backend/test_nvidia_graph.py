"""Resolve, gather and follower replay captured once in a CUDA graph, replayed on drifting steps.

The engine writes each step's inputs into the same tensors and replays the graph; the hot state
evolves on the GPU. After every replay the outputs, hot state, counters and device bytes must
equal the reference driven with the same inputs eagerly.
"""

from __future__ import annotations

import random

import pytest
import torch
from nvidia_support import Twin, random_step, random_tables, requires_gpu

from hisparse_core.geometry import RuntimeConfig
from hisparse_core.runtime import ResolveInputs

pytestmark = [requires_gpu, pytest.mark.gpu]


_PADDED = {"HISPARSE_SPEC_GATHER": "0", "HISPARSE_GATHER_PER_SM": "1", "HISPARSE_GATHER_BLOCKS": "8 per SM"}


@pytest.mark.parametrize(("rows_per_request", "env"),
                         [(1, {}), (2, {}), (1, {"HISPARSE_SPEC_ROWS": "2"}), (1, _PADDED)],
                         ids=["1", "2", "1-split", "1-padded"])
def test_graph_replay_across_drifting_steps(rows_per_request: int, env: dict[str, str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """HISPARSE_SPEC_ROWS=2: the captured copy is split, the speculative gather for rows 0-1 and
    the plan copy, following the resolver, for the rest. "1-padded": the plan copy alone, with a
    grid of 8 blocks per SM, too many to start beside the resolver, so that the captured launch
    asks for the shared memory that keeps one block an SM."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, value in env.items():
        monkeypatch.setenv(name, str(8 * sms) if value == "8 per SM" else value)
    rng = random.Random(21 + rows_per_request)
    cfg = RuntimeConfig(max_batch_rows=5, max_requests=3, top_k=256, hot_rows=512 * rows_per_request,
                        block_size=64, max_pages=32, num_layers=3, rows_per_request=rows_per_request)
    host_blocks = cfg.max_requests * cfg.max_pages
    dev_blocks = cfg.max_requests * cfg.hot_blocks + 64
    twin = Twin(cfg, host_blocks=host_blocks, num_device_blocks=dev_blocks, seed=5)
    try:
        if env is _PADDED:  # every free-SM count leaves too few SMs for 8 blocks an SM
            shape = twin.rt.launch_shape
            assert shape["plan_copy_pad_smem"] > 0 and shape["gather_blocks"] > sms * shape["plan_copy_per_sm"], shape
        tables = random_tables(cfg, host_blocks, dev_blocks, rng, resident_share=0.1, null_share=0.02)
        twin.set_tables(tables)
        assert twin.dev_tables is not None
        b = cfg.max_batch_rows
        static_topk = torch.full((b, cfg.top_k), -1, dtype=torch.int32, device=twin.dev)
        static_state = torch.full((b,), -1, dtype=torch.int32, device=twin.dev)
        static_lens = torch.zeros(b, dtype=torch.int32, device=twin.dev)
        inputs = ResolveInputs(static_topk, static_state, static_lens, twin.dev_tables.source,
                               twin.dev_tables.resident, twin.dev_tables.hot)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            twin.rt.resolve(inputs, gather=True, validate=False)
            twin.rt.replay_plan()
        assert twin.rt.stats().misses == 0  # capture ran nothing
        previous: dict = {}
        for i in range(12):
            step = random_step(cfg, rng, previous, locality=0.8, padding_share=0.2, batch_rows=b)
            n = step.topk.shape[0]
            # Pad the batch to the captured shape with padding rows.
            topk = torch.full((b, cfg.top_k), -1, dtype=torch.int32)
            state = torch.full((b,), -1, dtype=torch.int32)
            lens = torch.zeros(b, dtype=torch.int32)
            topk[:n], state[:n], lens[:n] = step.topk, step.row_state, step.seq_lens
            if i % 4 == 3:  # the engine spills a page between steps
                q = rng.randrange(cfg.max_requests)
                res = tables.resident[q]
                pages = (res >= 0).nonzero()
                if len(pages):
                    res[pages[0, 0]] = -1
                twin.set_tables(tables)
            static_topk.copy_(topk)
            static_state.copy_(state)
            static_lens.copy_(lens)
            graph.replay()
            padded = type(step)(topk, state, lens)
            twin.ref.resolve(twin.inputs(padded, device=False), gather=True, validate=False)
            twin.ref.replay_plan()
            twin.compare_all(f"replay {i}")
        assert twin.rt.stats().misses > 0 and twin.rt.stats().hits > 0
    finally:
        twin.close()
