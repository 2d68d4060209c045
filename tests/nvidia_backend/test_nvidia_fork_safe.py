"""Choosing a backend and registering vLLM's op set leave CUDA uninitialized, so a forked child can
still use the GPU. vLLM loads hisparse's general plugin (which registers the ops, and whose
connector check chooses a backend) in its front end and engine core, then forks the processes that
run the model; a parent that had called `cudaGetDeviceCount` (what `torch.cuda.is_available()` does,
here and in any process without vLLM's `PYTORCH_NVML_BASED_CUDA_CHECK=1`) or initialized torch's CUDA
state leaves them failing with "Cannot re-initialize CUDA in forked subprocess"."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("cuda.bindings", reason="cuda-python is not installed: pip install 'hisparse[nvidia]'")

from nvidia_support import requires_gpu  # noqa: E402

PROGRAM = textwrap.dedent("""
    import os
    import torch
    from hisparse_core.registry import get_registry
    from hisparse_vllm import ops

    assert get_registry().choose().name == "nvidia"     # every backend's probe ran
    assert ops.register_ops("nvidia") == "hisparse:nvidia"
    assert not torch.cuda.is_initialized(), "choosing or registering initialized CUDA"
    pid = os.fork()
    if pid == 0:
        try:
            x = torch.ones(4, device="cuda")
            os._exit(0 if int(x.sum()) == 4 else 3)
        except BaseException as exc:
            print("child:", exc, flush=True)
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the forked child could not use CUDA ({status})"
    dgi = torch.tensor([[5, 7, -1], [7, 2, 3]], dtype=torch.int32, device="cuda")
    torch.ops._C_cache_ops.hisparse_invalidate_written_slots(
        dgi, torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
        torch.tensor([0, 0], dtype=torch.int32, device="cuda"), torch.tensor([7, 5], dtype=torch.int64, device="cuda"))
    assert dgi.tolist() == [[-1, -1, -1], [7, 2, 3]], dgi
    print("ok")
""")


@requires_gpu
def test_choosing_and_registering_leave_a_forked_child_free_to_use_cuda() -> None:
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.stdout + proc.stderr)[-3000:]
