"""A tiny DeepSeek-V2 (MLA) on one of vLLM CPU's MLA attention backends, with the connector.

    python tests/vllm_connector/mla_run.py MODEL_DIR BACKEND loads     # prints ENGINE_REPORT {...}
    python tests/vllm_connector/mla_run.py MODEL_DIR BACKEND refused   # the engine as issue 16 ran it

Each engine runs in `mla_backends.engine_dtype(BACKEND)`: float32 on CPU_MLA, bfloat16 on
AMX_MLA (its kernels take nothing else); in bfloat16 the runs also keep each token's top-2 margin.

`loads`: RoPE in exact PyTorch (`custom_ops=["-rotary_embedding"]`, see
hisparse_vllm/engine_checks.py). Batch 1 publishes four prefixes to the host pool. Batch 2 (same
prefixes, other suffixes) then runs

1. `vllm_cache`: with vLLM's own prefix cache holding batch 1's blocks (where the backend allows
   prefix caching; the CPU platform turns it off for CPU_MLA),
2. `host`: after vLLM's cache is emptied, so the prefixes are loaded from the host pool,
3. `recompute`: after both caches are emptied, so nothing is reused,
4. `corrupt`: loaded from a host pool overwritten with noise (the outputs must change).

`refused`: the default eager engine, whose RoPE kernel mixes rows; the connector must refuse.

    python tests/vllm_connector/mla_run.py MODEL_DIR BACKEND compiled-plain|compiled-connector

`compiled-*` (issue 27, items 1 and 2): the model in bf16, compiled (no `enforce_eager`), without or
with the connector. Wave 1, fresh prompts (nothing to load): the connector's start-up RoPE check
ran in this engine, so the outputs must be vLLM's own, bit for bit. Wave 2 shares wave 1's
prefixes: loaded from host with the connector, recomputed without it (top-2 logprobs kept).
"""

from __future__ import annotations

import random
import sys
from typing import Any

import engine_driver as ed
from mla_backends import ENGINE_BLOCK, engine_dtype, prefixes

SUFFIX = 5


def engine(model_dir: str, backend: str, *, exact_rope: bool) -> Any:
    from vllm import LLM

    extra: dict[str, Any] = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if exact_rope else {}
    return LLM(model=model_dir, skip_tokenizer_init=True, dtype=engine_dtype(backend), max_model_len=1024, max_num_seqs=4,
               enforce_eager=True, seed=0, attention_config={"backend": backend},
               block_size=ENGINE_BLOCK[backend], kv_transfer_config=ed.kv_transfer(0.05),
               disable_log_stats=False, **extra)


def batches(block_size: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(16)
    shared = [[rng.randrange(3, 500) for _ in range(n)] for n in prefixes(block_size)]
    first = [p + [rng.randrange(3, 500) for _ in range(SUFFIX)] for p in shared]
    second = [p + [rng.randrange(3, 500) for _ in range(SUFFIX)] for p in shared]
    return first, second


def loads(model_dir: str, backend: str) -> dict[str, Any]:
    d = ed.Driver(engine(model_dir, backend, exact_rope=True))
    dtype = engine_dtype(backend)
    if dtype != "float32":   # top-2 logprobs: where tokens part, was it a near-tie?
        from vllm import SamplingParams

        d.params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=2)
    cache = d.llm.llm_engine.vllm_config.cache_config
    first, second = batches(cache.block_size)
    out: dict[str, Any] = {"block_size": cache.block_size, "vllm_prefix_caching": bool(cache.enable_prefix_caching),
                           "dtype": str(d.llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")}
    out["batch1"] = d.generate(first)
    d.drain()
    if out["vllm_prefix_caching"]:
        out["vllm_cache"] = d.generate(second)
        d.drain()
    assert d.llm.reset_prefix_cache()
    out["host"] = d.generate(second)
    d.drain()
    out["loaded_pages"] = d.side.loads.loaded_pages
    assert d.llm.reset_prefix_cache(reset_connector=True)
    out["recompute"] = d.generate(second)
    d.drain()
    assert d.llm.reset_prefix_cache()
    d.corrupt_host_pool()
    out["corrupt"] = d.generate(second)
    d.drain()
    out["metrics"] = d.metrics()
    return out


def compiled(model_dir: str, backend: str, connector: bool) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    extra: dict[str, Any] = {"kv_transfer_config": ed.kv_transfer(0.05)} if connector else {}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024, max_num_seqs=4, seed=0,
              attention_config={"backend": backend}, block_size=ENGINE_BLOCK[backend], **extra)
    d = ed.Driver(llm)
    first, second = batches(ENGINE_BLOCK[backend])
    out: dict[str, Any] = {"enforce_eager": llm.llm_engine.vllm_config.model_config.enforce_eager,
                           "wave": d.generate(first)}
    d.drain()
    # Issue 27, item 2: wave 2 shares wave 1's prefixes. With the connector they load from host;
    # without it (CPU_MLA keeps no prefix cache) they are recomputed. Top-2 logprobs per token.
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=2)
    from vllm.inputs import TokensPrompt

    wave2 = []
    for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in second], params, use_tqdm=False):
        res = o.outputs[0]
        ranked = [sorted(lp.values(), key=lambda x: -x.logprob) for lp in res.logprobs]
        wave2.append({"tokens": list(res.token_ids), "cached": int(o.num_cached_tokens or 0),
                      "logprobs": [lp[t].logprob for t, lp in zip(res.token_ids, res.logprobs, strict=False)],
                      "margins": [r[0].logprob - r[1].logprob for r in ranked]})
    out["wave2"] = wave2
    return out


def refused(model_dir: str, backend: str) -> dict[str, Any]:
    try:
        engine(model_dir, backend, exact_rope=False)
    except Exception as exc:  # the engine's start-up error, whatever vLLM wraps it in
        return {"error": str(exc), "type": type(exc).__name__}
    return {"error": None}


if __name__ == "__main__":
    model, backend, mode = sys.argv[1:4]
    runs = {"loads": loads, "refused": refused, "compiled-plain": lambda m, b: compiled(m, b, False),
            "compiled-connector": lambda m, b: compiled(m, b, True)}
    ed.report(runs[mode](model, backend))
