"""Stands in for the `vllm` import so that vLLM's own HiSparse kernel tests
(`tests/kernels/attention/test_hisparse_kernels.py` in vLLM's source, copied unchanged into the
git-ignored `.vllm_tests/`) run against a hisparse backend's op set on a machine without vLLM.

Importing it registers the four `torch.ops._C_cache_ops.hisparse_*` ops through
`hisparse_vllm.ops.register_ops`, served by `HISPARSE_BACKEND` (nvidia by default). Nothing
installs it: the `vllm_tests` stage of `scripts/gpu_validate.sh`, or a command like the one in
docs/vllm.md, puts this folder on `PYTHONPATH`.

`HISPARSE_SHIM_DEVICE=cpu` (with `HISPARSE_BACKEND=reference_cpu`, or `triton` under
`TRITON_INTERPRET=1`) checks the same file on a CPU: pinning and `torch.accelerator.synchronize`
have no accelerator there, so both become no-ops.
"""

import os

from hisparse_vllm.ops import register_ops

register_ops(os.environ.get("HISPARSE_BACKEND", "nvidia"))

if os.environ.get("HISPARSE_SHIM_DEVICE") == "cpu":
    import torch

    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    torch.accelerator.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
