"""The nvidia backend's own settings: its tuning variables, each read by one parse function that
both `NvidiaBackend.check_settings` (before anything is allocated) and the code that builds what it
tunes call, so the check and the build cannot drift apart.

The variables of the runtime and the host pool live here, so that checking them imports neither the
CUDA driver bindings nor anything that touches a device (`runtime.py` and `host_pool.py` import the
driver); those of the kernel builds stay beside the builds, in `kernels.py` (the resolver's and copy
kernels' shapes, vLLM's op set), and the kernel cache's in `compiler.py`, neither of which touches a
device either. `check_settings()` reads every one of them.

A bound that needs the device (`HISPARSE_GATHER_BLOCKS`: at most 8 blocks an SM) is checked here as far
as it can be without it (`num_sms=None`: a whole number of at least 1) and again, exactly, when a
runtime is built.
"""

from __future__ import annotations

import os
import sys

from hisparse_core.errors import InvalidInputError
from hisparse_nvidia.kernels import env_int, env_int_in

#: "0" turns off programmatic dependent launch of the resolver and the plan copies (on by default).
ENV_OVERLAP = "HISPARSE_OVERLAP_LAUNCH"
#: "0" turns off the speculative gather after a resolve (on by default where it applies).
ENV_SPEC_GATHER = "HISPARSE_SPEC_GATHER"
#: "0": the plan copy after a resolve waits for the whole resolver instead of following the rows
#: it publishes (on by default).
ENV_GATHER_FOLLOW = "HISPARSE_GATHER_FOLLOW"
#: At most this many batch rows get the speculative gather (default: as many as one pass of it covers).
ENV_SPEC_ROWS = "HISPARSE_SPEC_ROWS"
#: "0": a batch larger than the speculative gather covers gets only the plan copy, instead of the
#: speculative gather for its first rows and the plan copy, following the resolver, for the rest.
ENV_SPEC_SPLIT = "HISPARSE_SPEC_SPLIT"
#: Blocks of the plan copy's persistent grid (default one per SM), for tuning. Fewer blocks in
#: flight measured faster right behind the resolver at batch 128 (docs/gpu-validation.md, call P1).
ENV_GATHER_BLOCKS = "HISPARSE_GATHER_BLOCKS"
#: Blocks of the plan copy's grid in `prefetch` (default half the SMs): its copies run beside the
#: attention they overlap, and every block they hold is one an SM's attention waits for. On the
#: H200, 32K code at batch 75 with the cross-layer prefetch, 66 blocks took 0.36-0.48 ms a step less
#: than 132 in alternated runs, while a grid of 66 for every plan copy cost the swap-in sweep 13 us
#: at 34 misses x 128 (docs/gpu-validation.md, calls N2-N3).
ENV_PREFETCH_GATHER_BLOCKS = "HISPARSE_PREFETCH_GATHER_BLOCKS"
#: A plan copy that follows a resolver leaving too few free SMs for its whole grid puts at most
#: this many blocks on one SM (0: no limit), by asking for more shared memory than one more block
#: would leave room for. Without it the blocks that find no free SM pile onto the first SMs the
#: resolver's blocks leave, as many as fit (5), and the copy ran on about 30 of the 132 SMs:
#: 1.26x the copy engine at batch 128 with 274 misses a request against 1.23x (docs/gpu-validation.md,
#: calls D2-D3). Such a copy waits for the whole resolver rather than following it (`_copy_choice`).
ENV_GATHER_PER_SM = "HISPARSE_GATHER_PER_SM"
GATHER_PER_SM = 1
#: The speculative gather covers every entry's slots in one pass of at most this many blocks per SM
#: (`HISPARSE_SPEC_BLOCKS_PER_SM` overrides, for tuning): 11 rows of top-k 2048 on 132 SMs. About
#: half of them fit beside the resolver; the rest start as its blocks leave. At batch 8 that beat
#: the plan copy by 8.7 us with 274 misses a request and lost 4.9 us on a step without misses
#: (docs/gpu-validation.md, calls S1-S5).
ENV_SPEC_BLOCKS_PER_SM = "HISPARSE_SPEC_BLOCKS_PER_SM"
SPEC_BLOCKS_PER_SM = 8
#: "0": every block of the speculative gather waits for the resolver; by default a block none of
#: whose entries can be a miss (no host entry, or each held at its hinted slot while the resolver
#: refills none of the request's slots) leaves at once, and only block 0 waits. A step without
#: misses at batch 8 cost the resolve alone + 5.4 us before (issue 28, docs/gpu-validation.md).
ENV_SPEC_EARLY_EXIT = "HISPARSE_SPEC_EARLY_EXIT"
#: Which speculative gather: "entries" (a block classifies up to 128 entries and reads only its
#: likely misses' slots early, so a step without misses is one wave of small blocks), "slots" (every
#: entry's every 16-byte slot a task of its own, the kernel of issue 15), or "auto" (the default:
#: slots for a batch of one row, whose 16 entry blocks read the host on too few SMs (274 misses:
#: 21.9 against 9.2 us), entries above; docs/gpu-validation.md, issue 28).
ENV_SPEC_KERNEL = "HISPARSE_SPEC_KERNEL"
SPEC_KERNELS = ("auto", "entries", "slots")
#: Entries a block of the entry kernel classifies (1-128), for tuning. By default 32 where the
#: speculative gather takes the whole batch (batch 8: 137 misses a request 19.4 us against 26.0 with
#: 128, 274 misses 33.7 against 36.8, no-miss steps equal) and 128 for the first rows of a split
#: batch (batch 32 and 64, measured only so; docs/gpu-validation.md, issue 28).
ENV_SPEC_EPB = "HISPARSE_SPEC_EPB"
#: Consecutive entries a block of the entry kernel takes together (its runs; every nb-th run of a row
#: is the block's), for tuning: 0 takes the block's entries all consecutive (the layout before the
#: thirty-fifth session). A decode's misses sit together in its top-k, and a block reads only
#: HS_SEARLY of its likely misses before the resolver ends; runs of 8 spread them over the row's
#: blocks and keep one 32-byte sector per 8 entries. The runtime uses gcd(run, entries a block).
ENV_SPEC_RUN = "HISPARSE_SPEC_RUN"
SPEC_RUN = 8
#: Set to 1 to unregister (and unmap) pools still held at interpreter exit (host_pool.py).
ENV_UNREGISTER_AT_EXIT = "HISPARSE_UNREGISTER_AT_EXIT"


def spec_kernel() -> str:
    """`HISPARSE_SPEC_KERNEL`: "auto" (default), "entries" or "slots"; anything else is one line naming it."""
    value = os.environ.get(ENV_SPEC_KERNEL, "auto")
    if value not in SPEC_KERNELS:
        raise InvalidInputError(f"{ENV_SPEC_KERNEL}={value!r}: expected auto (the default), entries or slots")
    return value


def env_switch(name: str) -> bool:
    """A switch that is on by default: unset or "1" on, "0" off; anything else ("false", "off",
    "no", "") is one line naming it. They were read as `!= "0"`, so `HISPARSE_OVERLAP_LAUNCH=false`
    left the launch overlap on, silently."""
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise InvalidInputError(f"{name}={value!r}: expected 1 (the default) or 0")
    return value == "1"


def copy_switches() -> tuple[bool, bool, bool]:
    """(`HISPARSE_OVERLAP_LAUNCH`, `HISPARSE_GATHER_FOLLOW`, `HISPARSE_SPEC_SPLIT`): each on unless
    "0", a value other than 0 or 1 one line naming it (`env_switch`)."""
    return env_switch(ENV_OVERLAP), env_switch(ENV_GATHER_FOLLOW), env_switch(ENV_SPEC_SPLIT)


def spec_early_exit() -> bool:
    """`HISPARSE_SPEC_EARLY_EXIT`: "1" (default) or "0"; anything else is one line naming it."""
    return env_switch(ENV_SPEC_EARLY_EXIT)


def spec_gather() -> bool:
    """`HISPARSE_SPEC_GATHER`: "1" (default) or "0" (`env_switch`)."""
    return env_switch(ENV_SPEC_GATHER)


def spec_rows_cap() -> int | None:
    """`HISPARSE_SPEC_ROWS`: the most batch rows the speculative gather takes (0: off), None when unset."""
    cap = env_int(ENV_SPEC_ROWS)
    if cap is not None and cap < 0:
        raise InvalidInputError(f"{ENV_SPEC_ROWS}={cap}: expected 0 (off) or more batch rows")
    return cap


def spec_blocks_per_sm() -> int:
    """`HISPARSE_SPEC_BLOCKS_PER_SM` (default `SPEC_BLOCKS_PER_SM`)."""
    return env_int_in(ENV_SPEC_BLOCKS_PER_SM, SPEC_BLOCKS_PER_SM, 0, 32, "0 (off) to 32 blocks per SM")


def spec_epb() -> int | None:
    """`HISPARSE_SPEC_EPB`: entries a block of the entry kernel classifies; None (unset or 0) for the
    runtime's choice."""
    return env_int_in(ENV_SPEC_EPB, 0, 0, 128, "0 (the default) or 1 to 128 entries a block") or None


def spec_run() -> int:
    """`HISPARSE_SPEC_RUN` (default `SPEC_RUN`): 0 for consecutive entries a block, else 1 to 128."""
    return env_int_in(ENV_SPEC_RUN, SPEC_RUN, 0, 128, "0 (consecutive) or 1 to 128 entries a run")


def gather_per_sm() -> int:
    """`HISPARSE_GATHER_PER_SM` (default `GATHER_PER_SM`); whether the plan copy's shared memory can
    hold an SM to so few blocks is the device's to say, when the runtime is built."""
    return env_int_in(ENV_GATHER_PER_SM, GATHER_PER_SM, 0, 32, "0 (as many as fit) to 32 blocks per SM")


def _grid_blocks(name: str, default: int, num_sms: int | None) -> int:
    if num_sms is None:  # no device: the bound that does not need one
        return env_int_in(name, default, 1, sys.maxsize, "1 or more blocks (at most 8 per SM)")
    return env_int_in(name, default, 1, 8 * num_sms, f"1 to {8 * num_sms} blocks (8 per SM)")


def gather_blocks(num_sms: int | None) -> int:
    """`HISPARSE_GATHER_BLOCKS` on a device of `num_sms` SMs (default one an SM); None: checked without
    the device (the default is then 1, for the check only)."""
    return _grid_blocks(ENV_GATHER_BLOCKS, num_sms or 1, num_sms)


def prefetch_gather_blocks(num_sms: int | None) -> int:
    """`HISPARSE_PREFETCH_GATHER_BLOCKS` on a device of `num_sms` SMs (default half of them); None as
    `gather_blocks`."""
    return _grid_blocks(ENV_PREFETCH_GATHER_BLOCKS, max(1, (num_sms or 1) // 2), num_sms)


def unregister_at_exit() -> bool:
    """`HISPARSE_UNREGISTER_AT_EXIT`: unset or "0" (default) off, "1" on; anything else ("true",
    "yes") is one line naming it, said when a pool is created (it was read as off, silently)."""
    value = os.environ.get(ENV_UNREGISTER_AT_EXIT, "0")
    if value not in ("0", "1"):
        raise InvalidInputError(f"{ENV_UNREGISTER_AT_EXIT}={value!r}: expected 0 (the default) or 1")
    return value == "1"


def check_settings() -> None:
    """Every variable of the nvidia backend, each by the parse function its build uses: one
    `InvalidInputError` for the first bad value (`NvidiaBackend.check_settings`). Touches no device."""
    from hisparse_nvidia import compiler, kernels

    kernels.resolve_threads()
    kernels.resolve_smem()
    kernels.resolve_cluster()
    kernels.CopyShape.from_env(16)
    variant = kernels.vllm_gather_variant()
    kernels.vllm_gather_local(variant)
    kernels.vllm_gather_per_sm()
    kernels.vllm_carveout()
    kernels.vllm_resolve_threads()
    kernels.vllm_resolve_variant()
    kernels.vllm_resolve_shape()
    kernels.vllm_resolve_pdl()
    copy_switches()
    spec_gather()
    spec_early_exit()
    spec_kernel()
    spec_rows_cap()
    spec_blocks_per_sm()
    spec_epb()
    spec_run()
    gather_per_sm()
    gather_blocks(None)
    prefetch_gather_blocks(None)
    unregister_at_exit()
    compiler.cache_dir()
