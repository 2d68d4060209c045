"""`Capability.VLLM_OPS`: a backend's vLLM HiSparse op set against the straightforward model
(vllm_ops_model.py), with the arguments vLLM 0.32's runtime passes (no miss_mask output); and its
argument checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hisparse_conformance.examples import examples
from hisparse_conformance.vllm_ops_model import random_case, run_model, run_ops
from hisparse_core.backend import Backend, Capability
from hisparse_core.errors import InvalidInputError

pytestmark = pytest.mark.requires_capability(Capability.VLLM_OPS)


def _case(backend: Backend, seed: int, rows_per_request: int, *, tables: bool = True,  # noqa: ANN202
          any_stride: bool = False):
    case = random_case(seed, rows_per_request=rows_per_request, tables=tables, any_stride=any_stride)
    if backend.device.type != "cpu":
        case.host = case.host.pin_memory()
    return case


@examples(25)
@given(seed=st.integers(0, 2**31 - 1), rows_per_request=st.sampled_from([1, 2]), tables=st.booleans(),
       any_stride=st.booleans())
def test_vllm_ops_match_the_model(hisparse_backend: Backend, seed: int, rows_per_request: int, tables: bool,
                                  any_stride: bool) -> None:
    """Every op against the model. `tables=False` calls the resolve without request ids and tables, as
    vLLM's own kernel tests do; `any_stride` gives state rows a region stride that is not a multiple of
    the hot block size (vLLM's tests use twice the top-k)."""
    case = _case(hisparse_backend, seed, rows_per_request, tables=tables, any_stride=any_stride)
    got = run_ops(hisparse_backend.vllm_ops(), case, hisparse_backend.device, miss_mask=False)
    want = run_model(case, miss_mask=False)
    for name in ("hot_out", "attention", "resolved", "valid", "swap_counts", "dgi", "lru", "stats", "hot",
                 "plan_hot", "plan_attention", "inv_dgi"):
        assert torch.equal(got[name], want[name]), name
    for r in range(want["swap_counts"].shape[0]):
        c = int(want["swap_counts"][r])
        assert torch.equal(got["swap_host"][r, :c], want["swap_host"][r, :c])
        assert torch.equal(got["swap_dev"][r, :c], want["swap_dev"][r, :c])


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
