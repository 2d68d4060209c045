"""Prompt-lookup decoding through hisparse against plain greedy decode, at long context.

Model: `DeepseekV32ForCausalLM` with DeepSeek-V3.2's attention geometry (bench_transformers.py's
`build_model`: hidden 7168, 128 heads, kv_lora 512 + rope 64, indexer 64 x 128, top-k 2048),
`--layers` layers, random bf16 weights (fp32 with --fp32), vocabulary 1024. The prompts are random
tokens with a repeated stretch (so the n-gram lookup finds candidates), prefilled through hisparse
in `--prefill-chunk` steps; the GPU budget is the smallest the engine accepts for the batch plus
`--gpu-slack`, so pages are released to host and verification rows miss.

Rows, each at `--contexts` (default 32768) and `--batches` (default 1 and 8), timed over
`--new` tokens per row (CUDA-synchronized wall time, prefill excluded):

- `plain`: one token a step, every step resolving one row per request;
- `lookup k`: prompt-lookup candidates (the last `--ngram` tokens matched in the row's own
  history, up to k following tokens proposed); a verification forward of c + 1 tokens a row
  (c: the fewest candidates any row of the batch has), resolved as one union per request, then a
  crop of the rejected ones. Batched, every row keeps the shortest accepted prefix of the batch
  (transformers' own assisted generation runs batch 1 only);
- `oracle k`: the same loop with the plain run's own tokens proposed, so every candidate is
  accepted: the ceiling a perfect draft would give (random weights rarely repeat the prompt, so
  lookup's acceptance is low).

Printed per row: tokens/s and its ratio to `plain` of the same batch and context, steps, the
acceptance (candidates kept / proposed), union rows shared, rollbacks, misses, and whether the
tokens equal plain's (greedy: they must, up to bf16 ties). Batch 1 also runs transformers'
`generate(prompt_lookup_num_tokens=k)` through hisparse (`generate lookup k`).

Run (on a GPU):  python bench/bench_assisted.py [--contexts 32768] [--batches 1,8] [--k 3] [--layers 4]
CPU smoke test:  python bench/bench_assisted.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_transformers import GEOMETRY, TINY, build_model  # noqa: E402

Propose = Callable[[int, list[int]], list[int]]


def lookup_proposer(k: int, ngram: int) -> Propose:
    """Prompt lookup: the latest earlier occurrence of the row's last `ngram` tokens, and up to k
    tokens after it."""
    def propose(_row: int, history: list[int]) -> list[int]:
        if len(history) <= ngram:
            return []
        tail = history[-ngram:]
        for start in range(len(history) - ngram - 1, -1, -1):
            if history[start:start + ngram] == tail:
                return history[start + ngram:start + ngram + k]
        return []
    return propose


def oracle_proposer(k: int, truth: list[list[int]], prompt_lens: list[int]) -> Propose:
    def propose(row: int, history: list[int]) -> list[int]:
        done = len(history) - prompt_lens[row]
        return truth[row][done:done + k]
    return propose


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_loop(model: Any, hs: Any, prompts: list[list[int]], new: int, k: int, propose: Propose | None,
                chunk: int) -> dict[str, Any]:
    """Greedy decode of `new` tokens a row through a HiSparseCache, with verification steps of up
    to k candidates when `propose` is given. Returns tokens, timings and counts."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    b = len(prompts)
    ids = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    cache = hs.new_cache(ids, mask, max_new_tokens=new + k + 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        t_prefill = shown = time.perf_counter()
        for a in range(0, width, chunk):
            e = min(width, a + chunk)
            out = model(input_ids=ids[:, a:e], attention_mask=mask[:, :e], position_ids=pos[:, a:e],
                        use_cache=True, past_key_values=cache)
            if time.perf_counter() - shown > 20:  # long prefills (batch 8 at 32K) show their progress
                shown = time.perf_counter()
                print(f"bench_assisted: prefill {e}/{width} tokens x {b} rows ({shown - t_prefill:.0f} s)",
                      file=sys.stderr, flush=True)
        last = out.logits[:, -1].argmax(-1)
        _sync(device)
        history = [list(p) + [int(t)] for p, t in zip(prompts, last.tolist(), strict=True)]
        next_pos = pos[:, -1:] + 1
        steps = proposed = kept = 0
        t0 = time.perf_counter()
        while min(len(h) - len(p) for h, p in zip(history, prompts, strict=True)) < new:
            cands = [propose(i, h)[:k] for i, h in enumerate(history)] if propose is not None else [[]] * b
            c = min(len(x) for x in cands)
            rows = [[h[-1]] + x[:c] for h, x in zip(history, cands, strict=True)]
            inp = torch.tensor(rows, dtype=torch.long, device=device)
            mask = torch.cat([mask, torch.ones((b, c + 1), dtype=mask.dtype, device=device)], dim=1)
            positions = next_pos + torch.arange(c + 1, device=device)
            logits = model(input_ids=inp, attention_mask=mask, position_ids=positions, use_cache=True,
                           past_key_values=cache).logits
            sel = logits.argmax(-1).tolist()                     # the host reads the choice, as generate does
            matched = []
            for x, s in zip(rows, sel, strict=True):
                n = 0
                while n < c and x[n + 1] == s[n]:
                    n += 1
                matched.append(n)
            a = min(matched)
            if c > a:
                cache.crop(-(c - a))
                mask = mask[:, :mask.shape[1] - (c - a)]
            for h, x, s in zip(history, rows, sel, strict=True):
                h.extend(x[1:a + 1] + [s[a]])
            next_pos = next_pos + a + 1
            steps += 1
            proposed += c * b
            kept += a * b
        _sync(device)
        seconds = time.perf_counter() - t0
    cache.finish()
    tokens = [h[len(p):len(p) + new] for h, p in zip(history, prompts, strict=True)]
    return dict(tokens=tokens, seconds=seconds, steps=steps, proposed=proposed, kept=kept,
                tokens_per_s=b * new / seconds if seconds else float("inf"))


def generate_lookup(model: Any, hs: Any, prompt: list[int], new: int, k: int, device: str) -> dict[str, Any]:
    """transformers' own `generate(prompt_lookup_num_tokens=k)` through hisparse (batch 1)."""
    ids = torch.tensor([prompt], device=device)
    prefill_before = hs.engine.totals.prefill_seconds
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, do_sample=False, prompt_lookup_num_tokens=k)
    _sync(torch.device(device))
    # Decode time: the generate's wall time less its prefill steps (engine time).
    seconds = time.perf_counter() - t0 - (hs.engine.totals.prefill_seconds - prefill_before)
    s = hs.stats()
    return dict(tokens=[out[0, ids.shape[1]:].tolist()], seconds=seconds, steps=s.verify_steps, proposed=0,
                kept=0, tokens_per_s=new / seconds if seconds > 0 else float("inf"))


#: Each row's prompt is this many tokens shorter than the one before (`make_prompts`).
PROMPT_STEP = 8


def make_prompts(batch: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    """Random tokens, the last quarter a copy of an earlier stretch (something for lookup to find)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(batch):
        n = context - PROMPT_STEP * i                          # lengths differ a little: left padding
        head = torch.randint(2, vocab, (n - n // 4,), generator=g).tolist()
        start = len(head) // 3
        out.append(head + head[start:start + n // 4])
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import hisparse_transformers
    from hisparse_transformers.engine import required_gpu_blocks

    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if (smoke or args.fp32) else torch.bfloat16
    geometry = TINY if smoke else GEOMETRY
    contexts, batches = args.contexts, args.batches
    model = build_model(geometry, args.layers, max(contexts) + args.new + 64, device, dtype)
    if device == "cuda" and dtype == torch.float32:
        # torch's float32 grouped_mm reads its group offsets on the host, so no decode step could be
        # captured; batched_mm computes the same experts on the device.
        model.set_experts_implementation("batched_mm")
        print("bench_assisted: float32 experts run batched_mm (grouped_mm on float32 cannot be captured)",
              file=sys.stderr, flush=True)
    vocab = model.config.vocab_size
    top_k, bs, k = geometry["index_topk"], args.block_size, args.k
    t_start = time.perf_counter()
    row_bytes = (geometry["kv_lora_rank"] + geometry["qk_rope_head_dim"]) * torch.empty((), dtype=dtype).element_size()
    block_bytes = args.layers * bs * row_bytes
    results: list[dict[str, Any]] = []
    for context in contexts:
        for batch in batches:
            hot = -(-(k + 2) * top_k // bs) * bs
            chunk_pages = -(-max(args.prefill_chunk, k + 1) // bs) + 1
            need = required_gpu_blocks(batch, hot // bs, chunk_pages) + args.gpu_slack
            pages = -(-(context + args.new + k + 64) // bs)
            kw = dict(host_pool_gib=1.5 * batch * (pages + 4) * block_bytes / 2**30 + 0.01,
                      gpu_kv_gib=need * block_bytes / 2**30, block_size=bs, max_batch=batch,
                      max_context=pages * bs, prefill_chunk=args.prefill_chunk, speculative_tokens=k,
                      backend=args.backend)
            prompts = make_prompts(batch, context, vocab, args.seed)
            if not results:
                # Warm-up (kernel compiles, first captures): plain and rejected-candidate steps.
                short = [p[:2 * args.prefill_chunk] for p in prompts]
                with hisparse_transformers.enable(model, **kw) as hs:
                    decode_loop(model, hs, short, 8, k, None, args.prefill_chunk)
                with hisparse_transformers.enable(model, **kw) as hs:
                    decode_loop(model, hs, short, 8, k, lambda _r, h: [(h[-1] + 1 + j) % vocab for j in range(k)],
                                args.prefill_chunk)
            rows = []
            # Each mode on a fresh engine: the same prefill, the same pages resident (no prefix hits
            # from an earlier mode's host pages).
            modes: list[tuple[str, Propose | None]] = [("plain", None), ("lookup", lookup_proposer(k, args.ngram))]
            for name, propose in modes + [("oracle", None)] + ([("generate", None)] if batch == 1 else []):
                with hisparse_transformers.enable(model, **kw) as hs:
                    before = hs.stats()
                    if name == "generate":
                        got = generate_lookup(model, hs, prompts[0], args.new, k, device)
                    else:
                        if name == "oracle":
                            propose = oracle_proposer(k, rows[0][1]["tokens"], [len(p) for p in prompts])
                        got = decode_loop(model, hs, prompts, args.new, k, propose, args.prefill_chunk)
                    label = {"plain": "plain", "generate": f"generate lookup {k}"}.get(name, f"{name} {k}")
                    rows.append((label, got, hs.stats(), before))
                if device == "cuda":
                    # The model's own indexer scores a prefill chunk against the whole context in
                    # float32 (tens of GiB at 16K x batch 8); give the next mode's prefill the
                    # memory this mode's engine left cached.
                    torch.cuda.empty_cache()
                print(f"bench_assisted: context {context}, batch {batch}, {label}: {got['tokens_per_s']:.1f} tokens/s "
                      f"({time.perf_counter() - t_start:.0f} s so far)", file=sys.stderr, flush=True)
            plain = rows[0][1]
            for name, got, after, before in rows:
                results.append(dict(
                    context=context, batch=batch, mode=name, tokens_per_s=got["tokens_per_s"],
                    ratio=got["tokens_per_s"] / plain["tokens_per_s"], steps=got["steps"],
                    acceptance=got["kept"] / got["proposed"] if got["proposed"] else None,
                    union_shared=after.union_shared_entries - before.union_shared_entries,
                    rollbacks=after.rollbacks - before.rollbacks, misses=after.misses - before.misses,
                    same_tokens=got["tokens"] == plain["tokens"]))
    return results


def table(results: Sequence[dict[str, Any]]) -> str:
    head = ("context", "batch", "mode", "tokens/s", "x plain", "steps", "accepted", "union shared", "rollbacks",
            "misses", "= plain")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in results:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        lines.append(" | ".join(str(v) for v in (
            r["context"], r["batch"], r["mode"], f"{r['tokens_per_s']:.1f}", f"{r['ratio']:.2f}", r["steps"], acc,
            r["union_shared"], r["rollbacks"], r["misses"], "yes" if r["same_tokens"] else "NO")))
    return "\n".join(lines)



#: What --smoke sets (a tiny geometry on the CPU) where the flag is not given.
SMOKE = {"contexts": [120], "batches": [1, 3], "new": 8, "layers": 2, "block_size": 4, "prefill_chunk": 16,
         "gpu_slack": 8, "backend": "reference_cpu"}
#: The defaults without --smoke.
DEFAULTS = {"contexts": [32768], "batches": [1, 8], "new": 64, "layers": 4, "block_size": 64, "prefill_chunk": 256,
            "gpu_slack": 64, "backend": "auto"}


def main(argv: list[str] | None = None) -> int:
    from hisparse_core.cli.options import (
        MAX_BLOCK_SIZE,
        MAX_LAYERS,
        MAX_REQUESTS,
        MAX_SEED,
        MAX_TOKENS,
        CliParser,
        check_backend_name,
        check_output_path,
        int_in,
        int_list_in,
    )

    d = DEFAULTS
    p = CliParser(prog="bench_assisted", description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int_list_in(1, MAX_TOKENS), help=f"default: {d['contexts'][0]}")
    p.add_argument("--batches", type=int_list_in(1, MAX_REQUESTS), help="default: 1,8")
    p.add_argument("--k", type=int_in(1, 64), default=3, help="candidate tokens per verification step")
    p.add_argument("--ngram", type=int_in(1, MAX_TOKENS), default=2, help="tokens the lookup matches")
    p.add_argument("--new", type=int_in(1, MAX_TOKENS), help=f"tokens decoded per row (default: {d['new']})")
    p.add_argument("--layers", type=int_in(1, MAX_LAYERS), help=f"default: {d['layers']}")
    p.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), help=f"default: {d['block_size']}")
    p.add_argument("--prefill-chunk", type=int_in(1, MAX_TOKENS), help=f"default: {d['prefill_chunk']}")
    p.add_argument("--gpu-slack", type=int_in(0, 1 << 24),
                   help=f"GPU blocks above the smallest budget the engine accepts (default: {d['gpu_slack']})")
    p.add_argument("--backend", help=f"default: {d['backend']}")
    p.add_argument("--fp32", action="store_true", help="fp32 weights (default bf16)")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--smoke", action="store_true",
                   help="tiny geometry on the CPU, short contexts (a smoke test); flags given override its values")
    args = p.parse_args(argv)
    if args.json and (why := check_output_path("--json", args.json)):
        p.exit(2, f"bench_assisted: error: {why} (see bench_assisted --help)\n")
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # Row i's prompt is 8 x i tokens shorter than --contexts (make_prompts): one left without a token
    # was a RuntimeError traceback (a tensor of negative dimension) once the model was built.
    shortest = min(args.contexts) - PROMPT_STEP * (max(args.batches) - 1)
    if shortest < 1:
        p.error(f"argument --contexts: a batch of {max(args.batches)} (--batches) makes its last prompt "
                f"{PROMPT_STEP} x {max(args.batches) - 1} tokens shorter than --contexts {min(args.contexts)}, so no "
                f"token is left; expected --contexts >= {PROMPT_STEP * (max(args.batches) - 1) + 1}, or --batches <= "
                f"{(min(args.contexts) - 1) // PROMPT_STEP + 1}")
    if args.backend != "auto" and (why := check_backend_name(args.backend)):
        p.exit(2, f"bench_assisted: error: {why}\n")
    if not args.smoke and not torch.cuda.is_available():
        print("bench_assisted: no CUDA device; run with --smoke for the CPU smoke test", file=sys.stderr)
        return 2
    results = run(args)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    bad = [r for r in results if not r["same_tokens"]]
    if bad and (args.smoke or args.fp32):
        print(f"bench_assisted: {len(bad)} rows differ from plain greedy decode (fp32 must not)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from hisparse_core.cli.options import run_script

    raise SystemExit(run_script(main))
