"""Tensor parallelism on the CPU: two processes (torch.distributed over gloo), each loading the model
with transformers' own `tp_plan="auto"`, decode through hisparse with one shared reference_cpu
host pool (rank 0 writes it, rank 1 maps the same /dev/shm file and writes nothing), exact against
one process; private per-rank pools; the refusals: ranks that disagree on the pool, a pool name
a live process holds; and a rank killed with SIGKILL mid-decode (the survivor names it in one
line, /dev/shm keeps nothing).

One spawn of both ranks runs every scenario (`tp_ranks.py`), so the processes start once.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from tf_support import BLOCK, SHAPES, baseline, random_prompts, tiny_model
from tp_ranks import Scenario, run_ranks

import hisparse_transformers
from hisparse_core.geometry import RuntimeConfig  # noqa: F401  - loads the row formats the pool spec names
from hisparse_core.host_pool import HostPoolSpec
from hisparse_reference_cpu.host_pool import ReferenceHostPool, shm_path
from hisparse_transformers.kv_rows import row_format_for

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="tp_plan needs accelerate (pip install 'hisparse[transformers]')")

FAMILY = "glm_moe_dsa"          # a full layer with a follower, then a full layer: every structure
#: 53 pages and 2 hot buffers overflow the smallest pool of max_batch=2 and 16-token prefill chunks
#: (56 blocks): pages are released, lost and read back from the shared pool.
LENGTHS = [110, 90]
NEW = 6
CHUNK = 16
SIZES = dict(host_pool_gib=0.01, block_size=BLOCK, hot_rows=16, max_batch=2, max_context=256, prefill_chunk=CHUNK)


def _gpu_gib(blocks: int = 56) -> float:
    s = SHAPES[FAMILY]
    return blocks * s.layers * BLOCK * (s.kv_lora + s.rope) * 4 / 2**30


def by(results: list[dict[str, Any]], scenario: str) -> tuple[dict[str, Any], dict[str, Any]]:
    got = {r["rank"]: r for r in results if r["scenario"] == scenario}
    return got[0], got[1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tp") / FAMILY)
    tiny_model(FAMILY, shape=SHAPES[FAMILY], seed=3).save_pretrained(path)
    return path


def test_two_tp_ranks_share_one_host_pool_exact_against_one_process(saved: str) -> None:
    ids, mask = random_prompts(LENGTHS, seed=1)
    model = tiny_model(FAMILY, shape=SHAPES[FAMILY], seed=3)
    theirs = baseline(model, ids, mask, NEW, chunk=CHUNK)              # one process, the model's own
    with hisparse_transformers.enable(model, gpu_kv_gib=_gpu_gib(), **SIZES) as hs:
        one = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        one_stats = hs.stats()
    assert torch.equal(one.sequences, theirs.sequences)

    # A pool name a live process (this one) holds: rank 0 names the file and that process; rank 1
    # says rank 0 failed, and maps nothing.
    held_name = f"i34held_{os.getpid()}"
    fmt = row_format_for(torch.float32, SHAPES[FAMILY].kv_lora + SHAPES[FAMILY].rope)
    held = ReferenceHostPool(HostPoolSpec(num_layers=1, num_blocks=4, block_size=BLOCK, row_format=fmt, shared=True,
                                          name=held_name, rank=0, world_size=2))
    try:
        scenarios = [
            Scenario("shared", dict(gpu_kv_gib=_gpu_gib(), **SIZES)),
            Scenario("private", dict(gpu_kv_gib=_gpu_gib(), share_host_pool=False, **SIZES)),
            Scenario("disagree", dict(gpu_kv_gib=_gpu_gib(), **SIZES), rank1=dict(host_pool_gib=0.02), generate=False),
            Scenario("held", dict(gpu_kv_gib=_gpu_gib(), pool_name=held_name, **SIZES), generate=False),
            # Last: rank 1 kills itself (SIGKILL) after its 3rd step.
            Scenario("kill -9", dict(gpu_kv_gib=_gpu_gib(), **SIZES), kill_rank=1, kill_step=3),
        ]
        results = run_ranks(saved, scenarios, (ids, mask), new=NEW, chunk=CHUNK)
    finally:
        held.release()
    assert not os.path.exists(shm_path(held_name))

    r0, r1 = by(results, "shared")
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["shared"] and r1["shared"] and r0["writer"] and not r1["writer"]
    assert r0["pool_name"] == r1["pool_name"] and r0["inode"] == r1["inode"]     # one file, mapped by both
    assert not r0["linked"] and not r1["linked"]         # every rank mapped it: its name is gone from /dev/shm
    # Per replica: the same pool as one process's, not one per rank.
    assert r0["host_pool_bytes"] == r1["host_pool_bytes"] == one_stats.host_pool_bytes
    for r in (r0, r1):
        assert r["tokens"] == theirs.sequences.tolist()
        diff = max(float((torch.from_numpy(a) - b).abs().max()) for a, b in zip(r["logits"], theirs.logits, strict=True))
        assert diff <= 1e-4, diff
        stats = {k: r[k] for k in ("misses", "lost", "released", "h2d", "d2h")}
        assert r["misses"] > 0 and r["lost"] > 0 and r["h2d"] > 0, stats      # read back from the shared pool
    assert r0["d2h"] > 0 and r1["d2h"] == 0                               # only rank 0 wrote it

    p0, p1 = by(results, "private")
    assert "error" not in p0 and "error" not in p1, (p0.get("error"), p1.get("error"))
    assert not p0["shared"] and not p1["shared"] and p0["writer"] and p1["writer"]
    assert p0["tokens"] == p1["tokens"] == theirs.sequences.tolist() and p1["d2h"] > 0

    d0, d1 = by(results, "disagree")
    for d in (d0, d1):
        assert d["lines"] == 1 and d["error"].startswith("InvalidInputError: tensor-parallel rank 1 disagrees "
                                                         "with rank 0 on the host pool: host_pool_gib="), d["error"]

    h0, h1 = by(results, "held")
    assert h0["lines"] == 1 and f"{shm_path(held_name)}) is in use by live process {os.getpid()}" in h0["error"]
    assert h1["lines"] == 1 and h1["error"].startswith("InvalidInputError: rank 0 could not create its hisparse "
                                                       "engine, so this rank maps no pool:"), h1["error"]
    assert shm_path(held_name) in h1["error"]

    # The survivor names its dead peer in one line; the shared pool's file had no name left to leak.
    k0 = next(r for r in results if r["scenario"] == "kill -9")
    assert k0["rank"] == 0 and k0["shared"] and not k0["linked"]
    assert k0["lines"] == 1 and k0["error"].startswith("ProtocolError: rank 0: tensor-parallel rank 1 (pid "), k0
    assert ") died, so this replica cannot go on" in k0["error"]
    assert not os.path.exists(shm_path(k0["pool_name"]))
