"""Ranks and devices on GPUs with the nvidia backend (fp32; skipped without the GPUs they need).

- One GPU: two ranks (two processes, each running the whole model on the GPU, `tp=True`) map one
  shared nvidia host pool: rank 0 writes it, rank 1 maps the same /dev/shm file and orders its
  reads on rank 0's CUDA IPC event. Exact against one rank (and against the model's own
  generate), and only rank 0 copies device to host.
- Two GPUs (skipped, saying so, with fewer): `from_pretrained(device_map=...)` over both GPUs in one
  process, exact against the model's own generate; TP=2 (`tp_plan="auto"` over NCCL, rank r on
  GPU r) with one shared pool, exact against one process; kill -9 of either rank leaves nothing in
  /dev/shm and the survivor names its dead peer in one line.

The models have 32 indexer heads (`NO_TIES`): no exactly tied indexer score decides a top-k, so a
captured decode step (CUDA graphs, on by default) picks the same keys as the model's own eager
step (test_transformers_graphs.py says why that matters).
"""

from __future__ import annotations

import os

import pytest
import torch
from tf_support import BLOCK, GEN, NO_TIES, NVIDIA_ONLY, baseline, compare, random_prompts, tiny_model
from tp_ranks import Scenario, run_ranks

import hisparse_transformers
from hisparse_core import shm

pytest.importorskip("transformers")


def shm_path(name: str) -> str:
    """The /dev/shm file of the nvidia shared pool `name` (hisparse_nvidia.host_pool.shm_path,
    without importing the backend where it cannot load)."""
    return shm.shm_path(name, ".nvpool")

FAMILY = "glm_moe_dsa"
SHAPE = NO_TIES[FAMILY]
LENGTHS = [70, 90, 50]
NEW = 16
CHUNK = 8
SIZES = dict(host_pool_gib=0.01, block_size=BLOCK, hot_rows=16, max_batch=3, max_context=256, prefill_chunk=CHUNK)

pytestmark = NVIDIA_ONLY


def _gpu_gib(layers: int = SHAPE.layers, blocks: int = 58) -> float:
    """`blocks` pages of `layers` layers: 3 requests of up to 106 tokens need 59 pages plus hot buffers."""
    return blocks * layers * BLOCK * (SHAPE.kv_lora + SHAPE.rope) * 4 / 2**30


def _two_gpus() -> str | None:
    n = torch.cuda.device_count()
    return None if n >= 2 else f"needs two CUDA GPUs, this machine has {n}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("gpu_ranks") / FAMILY)
    tiny_model(FAMILY, shape=SHAPE, seed=3).save_pretrained(path)
    return path


def _as_the_ranks_load(saved: str, device: str) -> torch.nn.Module:
    """The saved model, loaded as `tp_ranks.run_rank` loads it: the weights the ranks run. Not
    `tiny_model(..., device="cuda")`, whose init on the GPU draws other weights (from the CUDA
    generator) than the CPU init `saved` holds: the one-GPU test failed its first GPU run on that."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).to(device).eval()


def _diff(logits: list, want: tuple) -> float:
    return max(float((torch.as_tensor(a) - b.float().cpu()).abs().max()) for a, b in zip(logits, want, strict=True))


def test_two_ranks_on_one_gpu_share_the_nvidia_pool_exact_against_one_rank(saved: str) -> None:
    model = _as_the_ranks_load(saved, "cuda")
    ids, mask = random_prompts(LENGTHS, seed=1)
    ids, mask = ids.cuda(), mask.cuda()
    theirs = baseline(model, ids, mask, NEW, chunk=CHUNK)
    with hisparse_transformers.enable(model, backend="nvidia", gpu_kv_gib=_gpu_gib(), **SIZES) as hs:
        one = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **GEN)
        one_stats = hs.stats()
    assert compare(one, theirs).tokens_equal and one_stats.misses > 0
    del model
    torch.cuda.empty_cache()

    results = run_ranks(saved, [Scenario("shared", dict(gpu_kv_gib=_gpu_gib(), tp=True, **SIZES))],
                        (ids.cpu(), mask.cpu()), backend="nvidia", device="cuda", tp_plan=False, new=NEW, chunk=CHUNK)
    r0, r1 = (next(r for r in results if r["rank"] == k) for k in (0, 1))
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["shared"] and r1["shared"] and r0["writer"] and not r1["writer"] and r0["inode"] == r1["inode"]
    assert not r0["linked"] and not os.path.exists(shm_path(r0["pool_name"]))
    for r in (r0, r1):
        assert r["tokens"] == one.sequences.tolist()
        assert _diff(r["logits"], one.logits) <= 1e-4
        assert r["misses"] > 0 and r["host_pool_bytes"] == one_stats.host_pool_bytes
    assert r0["d2h"] > 0 and r1["d2h"] == 0


@pytest.mark.skipif(_two_gpus() is not None, reason=str(_two_gpus()))
def test_device_map_across_two_gpus_matches_the_model(saved: str) -> None:
    pytest.importorskip("accelerate", reason="device_map needs accelerate (pip install 'hisparse[transformers]')")
    import transformers

    layers = {0: 0, 1: 0, 2: 1}                   # the index group 0-1 on GPU 0, full layer 2 on GPU 1
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    device_map.update({f"model.layers.{i}": d for i, d in layers.items()})
    model = transformers.AutoModelForCausalLM.from_pretrained(saved, device_map=device_map, dtype=torch.float32)
    model.eval()
    ids, mask = random_prompts(LENGTHS, seed=1)
    ids, mask = ids.to("cuda:0"), mask.to("cuda:0")
    theirs = baseline(model, ids, mask, NEW, chunk=CHUNK)
    with hisparse_transformers.enable(model, backend="nvidia", gpu_kv_gib=_gpu_gib(layers=2), **SIZES) as hs:
        e = hs.engine
        assert [str(d) for d in e.placement.devices] == ["cuda:0", "cuda:1"]
        assert [w.backend.device for w in e.workers] == [torch.device("cuda", 0), torch.device("cuda", 1)]
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **GEN)
        s = hs.stats()
    got = compare(ours, theirs)
    assert got.tokens_equal and got.max_logit_diff <= 1e-4, got
    assert s.misses > 0 and s.lost_pages > 0, s


@pytest.mark.skipif(_two_gpus() is not None, reason=str(_two_gpus()))
@pytest.mark.parametrize("victim", [1, 0])
def test_tp2_on_two_gpus_shares_one_pool_exact_and_survives_kill_9(saved: str, victim: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("accelerate", reason="tp_plan needs accelerate (pip install 'hisparse[transformers]')")
    model = _as_the_ranks_load(saved, "cuda:0")
    ids, mask = random_prompts(LENGTHS, seed=1)
    theirs = baseline(model, ids.cuda(), mask.cuda(), NEW, chunk=CHUNK)          # one process, one GPU
    del model
    torch.cuda.empty_cache()
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")  # the ranks' NCCL waits with a dead peer raise, not abort
    scenarios = [Scenario("shared", dict(gpu_kv_gib=_gpu_gib(), **SIZES)),
                 Scenario("kill -9", dict(gpu_kv_gib=_gpu_gib(), **SIZES), kill_rank=victim, kill_step=12)]
    results = run_ranks(saved, scenarios, (ids, mask), backend="nvidia", device="cuda", tp_plan=True, new=NEW,
                        chunk=CHUNK, timeout_s=400)
    r0, r1 = (next(r for r in results if r["rank"] == k and r["scenario"] == "shared") for k in (0, 1))
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["shared"] and r1["shared"] and r0["writer"] and not r1["writer"]
    assert r0["inode"] == r1["inode"] and not r0["linked"]        # one physical pool, mapped by both
    assert r0["host_pool_bytes"] == r1["host_pool_bytes"]
    for r in (r0, r1):
        assert r["tokens"] == theirs.sequences.tolist()
        assert _diff(r["logits"], theirs.logits) <= 1e-4
    survivor = next(r for r in results if r["scenario"] == "kill -9")
    assert survivor["rank"] == 1 - victim and survivor["lines"] == 1, survivor
    # Named by hisparse_transformers' step exchange ("tensor-parallel rank 0 (pid N) died") or, for a
    # dead rank 0, possibly first by the nvidia peer's wait on its writes ("rank 0 (pid N ...) died").
    assert f"rank {victim} (pid " in survivor["error"] and "died" in survivor["error"], survivor
    assert not os.path.exists(shm_path(survivor["pool_name"]))
