"""The nvidia backend's vLLM op set (hisparse_nvidia.vllm_ops) against reference_cpu's, byte for byte,
eagerly and replayed from a captured CUDA graph. Skips without a GPU."""

from __future__ import annotations

import pytest
import torch
from nvidia_support import gpu_reason

from hisparse_conformance.vllm_ops_model import random_case, run_ops
from hisparse_reference_cpu.vllm_ops import ReferenceVllmOps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_reason() is not None, reason=str(gpu_reason()))]

# Outputs the nvidia adapter fixes exactly (miss_mask is not served: vLLM 0.32 passes None).
COMPARED = ("hot_out", "attention", "resolved", "valid", "swap_counts", "dgi", "lru", "stats", "hot", "plan_hot",
            "plan_attention", "inv_dgi")


def _ops():
    from hisparse_nvidia.backend import NvidiaBackend

    return NvidiaBackend().vllm_ops()


def _pinned(case):
    case.host = case.host.pin_memory()
    return case


def _plan_rows(got, want):
    for r in range(want["swap_counts"].shape[0]):
        c = int(want["swap_counts"][r])
        assert torch.equal(got["swap_host"][r, :c], want["swap_host"][r, :c])
        assert torch.equal(got["swap_dev"][r, :c], want["swap_dev"][r, :c])


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("rows_per_request", [1, 2])
def test_nvidia_vllm_ops_match_reference(seed: int, rows_per_request: int) -> None:
    case = _pinned(random_case(seed, rows_per_request=rows_per_request))
    want = run_ops(ReferenceVllmOps(), case, miss_mask=False)
    got = run_ops(_ops(), case, "cuda", miss_mask=False)
    for name in COMPARED:
        assert torch.equal(got[name], want[name]), name
    _plan_rows(got, want)


def test_resolve_and_gather_compact_capture_in_a_cuda_graph() -> None:
    ops = _ops()
    case = _pinned(random_case(11, rows_per_request=2))
    args = case.resolve_args("cuda", miss_mask=False)
    fresh = [a.clone() if isinstance(a, torch.Tensor) and a.is_cuda else a for a in args]
    ops.resolve_residency(*args)  # warm-up: builds the runtime and its workspaces outside capture
    torch.cuda.synchronize()
    for a, f in zip(args, fresh, strict=True):
        if isinstance(a, torch.Tensor) and a.is_cuda:
            a.copy_(f)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.resolve_residency(*args)
        ops.gather_compact(args[0], args[1], args[19], args[20], args[21])
    for a, f in zip(args, fresh, strict=True):
        if isinstance(a, torch.Tensor) and a.is_cuda:
            a.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    ref = case.resolve_args("cpu", miss_mask=False)
    ReferenceVllmOps().resolve_residency(*ref)
    ReferenceVllmOps().gather_compact(ref[0], ref[1], ref[19], ref[20], ref[21])
    for i in (1, 4, 5, 6, 12, 18, 21):
        assert torch.equal(args[i].cpu(), ref[i]), i
