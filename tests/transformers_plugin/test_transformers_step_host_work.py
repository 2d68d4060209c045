"""The engine's host work on a decode step's critical path (issue 42): a step planned ahead starts
with a fixed number of tensor operations whatever the batch (the new ids reach the host in one
copy for the whole batch, and the step's device tensors were made in the planning), and the
request token ids that reach the coordinator are still the generated ones, through rollbacks."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tf_support import GEN, SHAPES, enable_kwargs, random_prompts, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import hisparse_transformers
from hisparse_transformers.tokens import LazyTokens, StagedIds

pytest.importorskip("transformers")

FAMILY = "deepseek_v32"


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model() -> Any:  # a transformers model (its generate is not on nn.Module)
    return tiny_model(FAMILY, shape=SHAPES[FAMILY], seed=3)


def _planned_begin_ops(model: Any, batch: int) -> list[list[str]]:
    """The tensor operations of each planned decode step's `begin_step`."""
    lengths = [40, 57, 23, 31, 45, 29][:batch]
    ids, mask = random_prompts(lengths, seed=batch)
    seen: list[list[str]] = []
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY, check=False, max_batch=6,
                                                              gpu_kv_gib=1e-3)) as hs:
        engine = hs.engine
        begin = engine.begin_step

        def counted(session: Any, input_ids: Any, num_new: int) -> Any:
            before = engine.ahead.claimed
            with _CountOps() as c:
                step = begin(session, input_ids, num_new)
            if engine.ahead.claimed > before:
                seen.append(c.ops)
            return step

        engine.begin_step = counted      # type: ignore[method-assign]
        model.generate(ids, attention_mask=mask, max_new_tokens=12, **GEN)
        del engine.begin_step
    return seen


def test_a_planned_decode_step_starts_with_the_same_few_ops_at_any_batch(model: Any) -> None:
    one = _planned_begin_ops(model, 1)
    six = _planned_begin_ops(model, 6)
    assert len(one) >= 8 and len(six) >= 8, (len(one), len(six))
    # One copy of the new ids for the whole batch (a slice and a copy per request before), and
    # no step tensor made here: positions, resolver rows and write rows came with the planning.
    assert {len(x) for x in one} == {len(x) for x in six}, (one[0], six[0])
    assert max(len(x) for x in six) <= 2, six[0]


@pytest.mark.parametrize("wider", [False, True])
def test_the_coordinator_reads_the_generated_ids(model: Any, wider: bool) -> None:
    lengths = [40, 57, 23]
    ids, mask = random_prompts(lengths, seed=11)
    with hisparse_transformers.enable(model, **enable_kwargs(FAMILY, check=False)) as hs:
        engine = hs.engine
        kept: list[list[int]] = []
        close = engine.close_session
        if wider:   # a caller's input_ids wider than the step: only its first num_new columns are the step's
            begin = engine.begin_step

            def widened(session: Any, input_ids: Any, num_new: int) -> Any:
                if input_ids is not None:
                    input_ids = torch.cat([input_ids, torch.full_like(input_ids[:, :1], -7)], 1)
                return begin(session, input_ids, num_new)

            engine.begin_step = widened      # type: ignore[method-assign]

        def keep(session: Any, **kw: Any) -> None:
            kept.extend(r.tokens.tolist() for r in session.requests)
            close(session, **kw)

        engine.close_session = keep      # type: ignore[method-assign]
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, **GEN)
        del engine.close_session
        if wider:
            del engine.begin_step
    seqs = out.sequences.tolist()
    width = ids.shape[1]
    for b, (row, tokens) in enumerate(zip(seqs, kept, strict=True)):
        pad = width - lengths[b]
        # every id the forwards wrote: the prompt and the generated ones but the last (never fed back)
        assert tokens == row[pad:-1], b


def _plain(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1 << 40) for _ in range(n)]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_lazy_tokens_match_a_plain_list(seed: int) -> None:
    rng = random.Random(seed)
    prompt = _plain(rng, rng.randrange(0, 9))
    tokens, model_list = LazyTokens(prompt), list(prompt)
    for _ in range(rng.randrange(1, 14)):
        op = rng.random()
        if op < 0.6:
            b, s = rng.randrange(1, 4), rng.randrange(1, 5)
            ids = torch.tensor([_plain(rng, s) for _ in range(b)], dtype=torch.int64)
            row, start = rng.randrange(b), rng.randrange(-s, s + 1)
            staged = StagedIds(ids)
            expect = ids[row, start:].tolist()
            ids.fill_(-1)                        # the caller's buffer is reused: the staged copy stands
            tokens.extend_staged(staged, row, start)
            model_list.extend(expect)
        elif op < 0.8:
            keep = rng.randrange(0, len(model_list) + 1)
            tokens.truncate(keep)
            del model_list[keep:]
        else:
            i = rng.randrange(-len(model_list), len(model_list)) if model_list else None
            if i is not None:
                assert tokens[i] == model_list[i]
        assert len(tokens) == len(model_list)
    assert tokens.tolist() == model_list
