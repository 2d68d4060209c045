"""`Capability.VLLM_OPS`: a backend's vLLM HiSparse op set against the straightforward model
(vllm_ops_model.py), with the arguments vLLM 0.32's runtime passes (no miss_mask output) and with a
miss_mask output as vLLM's own kernel tests pass it; out-of-range LRU slots; the invalidation of a
row held twice; and the argument checks."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hisparse_conformance.examples import examples
from hisparse_conformance.vllm_ops_model import invalidate_model, random_case, run_model, run_ops
from hisparse_core.backend import Backend, Capability
from hisparse_core.errors import InvalidInputError

pytestmark = pytest.mark.requires_capability(Capability.VLLM_OPS)


def _case(backend: Backend, seed: int, rows_per_request: int, *, tables: bool = True,  # noqa: ANN202
          any_stride: bool = False, corrupt_lru: bool = False):
    case = random_case(seed, rows_per_request=rows_per_request, tables=tables, any_stride=any_stride,
                       corrupt_lru=corrupt_lru)
    if backend.device.type != "cpu":
        case.host = case.host.pin_memory()
    return case



def _assert_like_the_model(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], miss_mask: bool,
                           note: str = "") -> None:
    """Every output of `run_ops` equals the model's (`miss_mask` where the resolve was passed one;
    the swap plan's rows up to each row's count, the rest being the op's to leave)."""
    for name in ("hot_out", "attention", "resolved", "valid", "swap_counts", "dgi", "lru", "stats", "hot",
                 "plan_hot", "plan_attention", "inv_dgi", *(("miss_mask",) if miss_mask else ())):
        assert torch.equal(got[name], want[name]), f"{name}: {note}" if note else name
    for r in range(want["swap_counts"].shape[0]):
        c = int(want["swap_counts"][r])
        assert torch.equal(got["swap_host"][r, :c], want["swap_host"][r, :c]), f"swap_host row {r} {note}"
        assert torch.equal(got["swap_dev"][r, :c], want["swap_dev"][r, :c]), f"swap_dev row {r} {note}"

@examples(25)
@given(seed=st.integers(0, 2**31 - 1), rows_per_request=st.sampled_from([1, 2]), tables=st.booleans(),
       any_stride=st.booleans(), miss_mask=st.booleans(), corrupt_lru=st.booleans())
def test_vllm_ops_match_the_model(hisparse_backend: Backend, seed: int, rows_per_request: int, tables: bool,
                                  any_stride: bool, miss_mask: bool, corrupt_lru: bool) -> None:
    """Every op against the model. `tables=False` calls the resolve without request ids and tables, as
    vLLM's own kernel tests do; `any_stride` gives state rows a region stride that is not a multiple of
    the hot block size (vLLM's tests use twice the top-k); `miss_mask` passes the resolve a miss-mask
    output (vLLM 0.32's runtime passes None, its kernel tests a tensor), which must then hold a 1 at
    each miss's first reference and a 0 elsewhere on every row that is not padding (padding rows keep
    what they held); `corrupt_lru` puts one out-of-range slot into one state row's LRU order."""
    case = _case(hisparse_backend, seed, rows_per_request, tables=tables, any_stride=any_stride,
                 corrupt_lru=corrupt_lru)
    got = run_ops(hisparse_backend.vllm_ops(), case, hisparse_backend.device, miss_mask=miss_mask)
    want = run_model(case, miss_mask=miss_mask)
    _assert_like_the_model(got, want, miss_mask)



@examples(15)
@given(seed=st.integers(0, 2**31 - 1), miss_mask=st.booleans(), least_recent=st.booleans())
def test_an_out_of_range_lru_slot_is_never_read(hisparse_backend: Backend, seed: int, miss_mask: bool,
                                                least_recent: bool) -> None:
    """A state row's LRU order holds an out-of-range slot (h + 7), placed where a backend that wrapped
    it onto (h + 7) % h would be seen (drawn cases put it anywhere, where such a backend is rarely
    caught): as the most recent slot, with the batch asking for the row the wrapped slot holds (it
    must not be read as that row's hit), or as the least recent one, with the batch's first entry a
    miss (its victim; the miss degrades to -1 and no slot is written)."""
    case = _case(hisparse_backend, seed, 1, tables=False)
    s, h = case.lru.shape
    host_rows = case.host.shape[0]
    r = next(r for r in range(case.rsi.numel()) if 0 <= int(case.rsi[r]) < s)
    q, wrapped = int(case.rsi[r]), (h + 7) % h
    case.lru[q, 0 if least_recent else h - 1] = h + 7
    held = [int(v) for v in case.dgi[q]]
    if least_recent:  # a row of the host cache that no slot holds
        x = next((x for x in range(host_rows) if x not in held), 0)
        case.dgi[q][case.dgi[q] == x] = -1
    elif not 0 <= held[wrapped] < host_rows:  # a row of the host cache, held by the wrapped slot alone
        x = next((x for x in range(host_rows) if x not in held), 0)
        case.dgi[q][case.dgi[q] == x] = -1
        case.dgi[q, wrapped] = x
    else:
        x = held[wrapped]
    case.topk[r, 0] = x
    got = run_ops(hisparse_backend.vllm_ops(), case, hisparse_backend.device, miss_mask=miss_mask)
    want = run_model(case, miss_mask=miss_mask)
    _assert_like_the_model(got, want, miss_mask, f"state row {q}'s LRU {case.lru[q].tolist()}")

def test_vllm_ops_check_arguments_first(hisparse_backend: Backend) -> None:
    ops = hisparse_backend.vllm_ops()
    case = _case(hisparse_backend, 1, 1)
    args = case.resolve_args(hisparse_backend.device, miss_mask=False)
    args[5] = args[5].to(torch.int64)  # device_global_indices
    lru = args[6].clone()
    with pytest.raises(InvalidInputError, match="device_global_indices has dtype torch.int64; expected torch.int32"):
        ops.resolve_residency(*args)
    assert torch.equal(args[6], lru)
    with pytest.raises(InvalidInputError, match="miss_counts"):
        ops.gather_compact(args[0], args[1], args[19], args[20], args[21][:0])


@examples(25)
@given(seed=st.integers(0, 2**31 - 1))
def test_invalidation_clears_every_copy_of_a_row(hisparse_backend: Backend, seed: int) -> None:
    """`invalidate_written_slots` on a hot map that holds some host rows in several slots of one state
    row (vLLM's kernel tests build such maps): a written row leaves every slot holding it, in its own
    request's state row only; a request outside `request_state_indices`, a padding request (-1) and
    a negative slot change nothing."""
    rng = random.Random(seed)
    s, h = rng.randint(1, 4), rng.randint(1, 12)
    values = rng.randint(1, 6)  # few distinct rows, so most are held more than once
    dgi = [[rng.choice([-1, *range(values)]) for _ in range(h)] for _ in range(s)]
    rsi = [rng.choice([-1, *range(s)]) for _ in range(rng.randint(1, s + 1))]
    nw = rng.randint(0, 8)
    req = [rng.randrange(-1, len(rsi) + 2) for _ in range(nw)]
    slots = [rng.randrange(-2, values + 1) for _ in range(nw)]
    dev = hisparse_backend.device
    got = torch.tensor(dgi, dtype=torch.int32, device=dev)
    hisparse_backend.vllm_ops().invalidate_written_slots(
        got, torch.tensor(rsi, dtype=torch.int32, device=dev), torch.tensor(req, dtype=torch.int32, device=dev),
        torch.tensor(slots, dtype=torch.int64, device=dev))
    want = invalidate_model(dgi, rsi, req, slots)
    assert got.cpu().tolist() == want, f"hot map {dgi}, requests' state rows {rsi}, written {list(zip(req, slots, strict=True))}"
