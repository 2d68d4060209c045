"""`NvidiaBackend.check_settings()` (CPU only: it asks no device): every `HISPARSE_*` variable the
backend's modules name, set to a bad value, is refused in one line naming it and the value, by the
parse function the runtime, the host pool, the kernel builds or vLLM's op set use themselves.

The variables are found in the package's source, so a new knob without a row in `BAD` (and a check in
`hisparse_nvidia.settings.check_settings`) fails `test_every_variable_of_the_package_has_bad_values`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hisparse_core.errors import InvalidInputError

pytest.importorskip("cuda.bindings", reason="cuda-python not installed: pip install 'hisparse[nvidia]'")

import hisparse_nvidia  # noqa: E402
from hisparse_nvidia import compiler, kernels, settings  # noqa: E402
from hisparse_nvidia.backend import NvidiaBackend  # noqa: E402

FILE = "<an existing file>"  # HISPARSE_KERNEL_CACHE's bad value: a path that is not a directory
BAD: dict[str, tuple[str, ...]] = {
    "HISPARSE_RESOLVE_THREADS": ("96", "many"),
    "HISPARSE_RESOLVE_SMEM": ("-1", "lots"),
    "HISPARSE_RESOLVE_CLUSTER": ("3", "16"),
    "HISPARSE_COPY_THREADS": ("100", "64"),
    "HISPARSE_COPY_UNROLL": ("3", "16"),
    "HISPARSE_COPY_LOAD": ("4", "-1"),
    "HISPARSE_VLLM_GATHER": ("1", "3", "fused"),
    "HISPARSE_VLLM_GATHER_LOCAL": ("5", "-1"),
    "HISPARSE_VLLM_GATHER_PER_SM": ("0", "9"),
    "HISPARSE_VLLM_CARVEOUT": ("101", "-2"),
    "HISPARSE_VLLM_RESOLVE": ("5", "7"),
    "HISPARSE_VLLM_RESOLVE_THREADS": ("100", "2048"),
    "HISPARSE_VLLM_RESOLVE_PDL": ("2",),
    "HISPARSE_VLLM_RESOLVE_SHAPE": ("2",),
    "HISPARSE_OVERLAP_LAUNCH": ("false", "2"),
    "HISPARSE_GATHER_FOLLOW": ("off",),
    "HISPARSE_SPEC_SPLIT": ("no",),
    "HISPARSE_SPEC_GATHER": ("true",),
    "HISPARSE_SPEC_EARLY_EXIT": ("yes",),
    "HISPARSE_SPEC_KERNEL": ("fast", "Entries"),
    "HISPARSE_SPEC_ROWS": ("-1", "all"),
    "HISPARSE_SPEC_BLOCKS_PER_SM": ("33", "-1"),
    "HISPARSE_SPEC_EPB": ("129", "-1"),
    "HISPARSE_SPEC_RUN": ("129", "-1", "eight"),
    "HISPARSE_GATHER_PER_SM": ("33", "-1"),
    "HISPARSE_GATHER_BLOCKS": ("0", "-3", "one"),
    "HISPARSE_PREFETCH_GATHER_BLOCKS": ("0", "half"),
    "HISPARSE_UNREGISTER_AT_EXIT": ("yes", "2"),
    "HISPARSE_KERNEL_CACHE": (FILE,),
}
#: Good values, one a variable, that the check accepts (the build may still say no for a given device).
GOOD: dict[str, str] = {
    "HISPARSE_RESOLVE_THREADS": "512", "HISPARSE_RESOLVE_SMEM": "0", "HISPARSE_RESOLVE_CLUSTER": "1",
    "HISPARSE_COPY_THREADS": "128", "HISPARSE_COPY_UNROLL": "8", "HISPARSE_COPY_LOAD": "3",
    "HISPARSE_VLLM_GATHER": "0", "HISPARSE_VLLM_GATHER_LOCAL": "0", "HISPARSE_VLLM_GATHER_PER_SM": "8",
    "HISPARSE_VLLM_CARVEOUT": "100", "HISPARSE_VLLM_RESOLVE": "6", "HISPARSE_VLLM_RESOLVE_THREADS": "1024",
    "HISPARSE_VLLM_RESOLVE_PDL": "0", "HISPARSE_VLLM_RESOLVE_SHAPE": "0", "HISPARSE_OVERLAP_LAUNCH": "0",
    "HISPARSE_GATHER_FOLLOW": "1", "HISPARSE_SPEC_SPLIT": "0", "HISPARSE_SPEC_GATHER": "0",
    "HISPARSE_SPEC_EARLY_EXIT": "0", "HISPARSE_SPEC_KERNEL": "slots", "HISPARSE_SPEC_ROWS": "0",
    "HISPARSE_SPEC_BLOCKS_PER_SM": "0", "HISPARSE_SPEC_EPB": "128", "HISPARSE_SPEC_RUN": "0", "HISPARSE_GATHER_PER_SM": "0",
    "HISPARSE_GATHER_BLOCKS": "100000", "HISPARSE_PREFETCH_GATHER_BLOCKS": "1", "HISPARSE_UNREGISTER_AT_EXIT": "1",
    "HISPARSE_KERNEL_CACHE": "off",
}


def package_variables() -> set[str]:
    """Every `HISPARSE_*` name the package's modules quote (its `ENV_*` constants among them)."""
    root = Path(hisparse_nvidia.__file__).parent
    found = {m for path in root.glob("*.py") for m in re.findall(r"[\"'](HISPARSE_[A-Z0-9_]+)[\"']", path.read_text())}
    for module in (kernels, settings, compiler):
        found |= {v for k, v in vars(module).items() if k.startswith("ENV_") and isinstance(v, str)}
    return found


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in BAD:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_every_variable_of_the_package_has_bad_values() -> None:
    assert package_variables() == set(BAD) == set(GOOD)


def test_a_clean_environment_is_accepted(clean_env: pytest.MonkeyPatch) -> None:
    assert NvidiaBackend.check_settings() is None


def test_good_values_are_accepted_all_at_once(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in GOOD.items():
        clean_env.setenv(name, value)
    assert NvidiaBackend.check_settings() is None


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, values in BAD.items() for v in values])
def test_each_bad_value_is_one_line_naming_the_variable(name: str, value: str, clean_env: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    if value == FILE:
        (tmp_path / "cache").write_text("not a directory")
        value = str(tmp_path / "cache")
    clean_env.setenv(name, value)
    with pytest.raises(InvalidInputError) as err:
        NvidiaBackend.check_settings()
    text = str(err.value)
    assert text.startswith(f"{name}=") and value in text and "expected" in text and "\n" not in text, text


def test_the_fused_gathers_local_path_needs_the_fused_gather(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("HISPARSE_VLLM_GATHER", "0")
    clean_env.setenv("HISPARSE_VLLM_GATHER_LOCAL", "1")
    with pytest.raises(InvalidInputError, match="^HISPARSE_VLLM_GATHER_LOCAL=1 is a path of the fused gather"):
        NvidiaBackend.check_settings()


def test_the_device_bound_is_exact_when_the_runtime_has_the_device(clean_env: pytest.MonkeyPatch) -> None:
    # 8 blocks an SM: checked without the device as "1 or more", against the SMs where a runtime is built.
    clean_env.setenv("HISPARSE_GATHER_BLOCKS", "1057")
    NvidiaBackend.check_settings()
    assert settings.gather_blocks(None) == 1057
    with pytest.raises(InvalidInputError, match=r"^HISPARSE_GATHER_BLOCKS=1057: expected 1 to 1056 blocks \(8 per SM\)"):
        settings.gather_blocks(132)
    assert settings.gather_blocks(133) == 1057


def test_the_check_imports_no_cuda_driver_wrapper_and_leaves_cuda_alone() -> None:
    # vLLM's front end runs it (op registration) and then forks the processes that use the GPU.
    program = textwrap.dedent("""
        import sys
        import torch
        from hisparse_nvidia.backend import NvidiaBackend
        NvidiaBackend.check_settings()
        loaded = sorted(m for m in ("hisparse_nvidia.driver", "hisparse_nvidia.runtime", "hisparse_nvidia.host_pool")
                        if m in sys.modules)
        assert not loaded, loaded
        assert not torch.cuda.is_initialized()
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISPARSE_")}
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
