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

A bad setting (a device other than `cuda` or `cpu`, `cuda` where torch has no CUDA device, a
backend that cannot serve the ops or serves them on another device than `HISPARSE_SHIM_DEVICE`,
`HISPARSE_VLLM_OPS` other than unset, `auto` or `replace`) ends the pytest run before any test, with one line naming the
variable, its value and what was expected: pytest reports it as the test file's one collection
error, `E   vllm.ShimSettingError: ...`, and runs no test (exit status 2).
"""

import os

from vllm.platforms import DEVICES, current_platform

__tracebackhide__ = True  # pytest shows the error's line, not this module's frames


class ShimSettingError(RuntimeError):
    """An environment variable of the shim names something it cannot run."""


def _setting(name: str, default: str) -> str:
    value = os.environ.get(name, "")
    return f"{name}={value!r}" if value.strip() else f"{name} is unset, so {default}"


def _refuse(message: str) -> None:
    __tracebackhide__ = True
    raise ShimSettingError(message)


_device = current_platform.device_type
if _device not in DEVICES:
    _refuse(f"HISPARSE_SHIM_DEVICE={_device!r}; expected one of {', '.join(DEVICES)}")
if _device == "cuda":
    import torch

    if not torch.cuda.is_available():
        _refuse(f"{_setting('HISPARSE_SHIM_DEVICE', 'cuda')}, but torch {torch.__version__} sees no CUDA device "
                "here; on a CPU set HISPARSE_SHIM_DEVICE=cpu with HISPARSE_BACKEND=reference_cpu (or triton under "
                "TRITON_INTERPRET=1)")

from hisparse_vllm.ops import ENV_MODE, register_ops, serving_device_type  # noqa: E402

# `off` would register nothing, and vLLM's tests skip every case ("not compiled into this build").
if os.environ.get(ENV_MODE, "").strip().lower() not in ("", "auto", "replace"):
    _refuse(f"{ENV_MODE}={os.environ[ENV_MODE]!r}: the shim serves vLLM's HiSparse ops from HISPARSE_BACKEND; "
            "expected it unset, auto or replace")

_problem = ""
try:
    register_ops(os.environ.get("HISPARSE_BACKEND", "").strip() or "nvidia")
    _served_on = serving_device_type()  # builds the backend: the tests' tensors must be on its device
except Exception as exc:  # noqa: BLE001 -- the reason is the line
    _problem = f"{_setting('HISPARSE_BACKEND', 'nvidia')} cannot serve vLLM's HiSparse ops: {exc}"
if _problem:
    _refuse(_problem)  # outside the handler: one error, not two chained
if _served_on is not None and _served_on != _device:
    _refuse(f"{_setting('HISPARSE_SHIM_DEVICE', 'cuda')}, but {_setting('HISPARSE_BACKEND', 'nvidia')} serves the "
            f"ops on {_served_on}, so every test would fail; expected HISPARSE_SHIM_DEVICE={_served_on} or a backend "
            f"that runs on {_device}")

if _device == "cpu":
    import torch

    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    torch.accelerator.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
