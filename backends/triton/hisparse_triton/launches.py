"""What a triton runtime launches for one profile of batch sizes (`auto.Profile`): the resolver and
its constexprs, the split resolver where it serves, the plan copy's constexprs and grid.

The runtime keeps one `Launches` per profile and picks it from a call's row count on the host;
every profile shares the runtime's state and scratch (`scratch_shape` sizes them for all).
Imports no triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hisparse_core.geometry import RuntimeConfig
from hisparse_triton import shapes
from hisparse_triton.auto import Profile


@dataclass(frozen=True, slots=True)
class Launches:
    """A profile's launches. `split_rows`: the split resolver serves batches of up to that many rows
    (0: none); larger ones take `resolver` (`shape`)."""

    max_rows: int
    tuning: shapes.Tuning
    shape: shapes.ResolverShape
    meta: dict[str, int]
    fuse_meta: dict[bool, dict[str, int]]
    split_shape: shapes.ResolverShape | None
    split_rows: int
    split_meta: dict[str, int]
    tail_meta: tuple[dict[str, int], dict[str, int], int] | None
    tail_warps: dict[str, int]
    plan_meta: dict[str, int]
    row_plan_meta: dict[str, int]
    plan_programs: int
    spec_meta: dict[str, Any]  # the speculative copy behind the split resolver (`shapes.SPEC_COPY_ENV`; empty: off)


def build(config: RuntimeConfig, profile: Profile, *, lanes: int, multiprocessors: int | None) -> Launches:
    """The launches of `profile` for `config` on a target of `lanes`-wide warps with `multiprocessors`
    (None: Triton's interpreter on the CPU)."""
    tune = profile.tuning
    cpu = multiprocessors is None
    b, k = config.max_batch_rows, config.top_k
    shape = shapes.resolver_shape(config, compiled=not cpu, variant=tune.resolver, threads=tune.threads,
                                  lean=tune.lean, cas=tune.cas, scan=tune.scan, shift=tune.shift,
                                  warp_size=lanes, split=tune.split, split_tail=tune.split_tail,
                                  split_keep=tune.split_keep)
    # The split resolver serves batches whose programs fit one wave (a multiprocessor each; in the
    # interpreter, batches up to half the workspace, so tests mix both resolvers on one state);
    # larger ones take the one-program resolver of the same switches.
    split_shape: shapes.ResolverShape | None = None
    split_meta: dict[str, int] = {}
    split_rows = 0
    tail_meta: tuple[dict[str, int], dict[str, int], int] | None = None
    tail_warps: dict[str, int] = {}
    if shape.split:
        split_shape = shape
        split_meta = dict(shape.constexprs) | ({} if cpu else dict(num_warps=shape.num_warps(lanes)))
        split_rows = max(1, b // 2) if multiprocessors is None else multiprocessors // shape.split
        # The hot-row kernels behind it (`shapes.SPLIT_TAIL_ENV`): same batch rows, their own programs.
        if shape.tail:
            tail_meta = (shape.hot_constexprs, shape.lru_constexprs | dict(PDL=int(tune.pdl)), shape.hot_programs)
        elif tune.pdl:  # the kernel the plan copy follows lets it launch early
            split_meta["PDL"] = 1
            if tune.pdl_chain:  # and is itself a dependent launch of the kernel before it (`shapes.PDL_CHAIN_ENV`)
                split_meta |= dict(PDL=2, launch_pdl=True)
        tail_warps = {} if cpu else dict(num_warps=shape.hot_warps(lanes))
        shape = shapes.resolver_shape(config, compiled=not cpu, variant=tune.resolver, threads=tune.threads,
                                      lean=tune.lean, scan=tune.scan, shift=tune.shift, warp_size=lanes)
    meta = dict(shape.constexprs) | (dict(PDL=1) if tune.pdl else {}) | ({} if cpu else dict(
        num_warps=shape.num_warps(lanes)))
    fuse_meta = {f: shape.fuse_constexprs(config, fused=f, interpreted=cpu) for f in (False, True)}
    copy_meta: dict[str, int] = {} if cpu else dict(num_warps=max(1, shapes.COPY_THREADS // lanes))
    plan_meta: dict[str, Any] = shapes.plan_copy_meta(config, interpreted=cpu, entries=tune.plan_entries) | copy_meta
    # Chained (`shapes.PDL_CHAIN_ENV`): the copies let a dependent launch (the next step's resolver) start once
    # their wait is over.
    chain = 2 if split_meta.get("PDL") == 2 else 1
    if tune.pdl:  # launched behind the resolver as a programmatic dependent (waits in the kernel)
        plan_meta |= dict(PDL=chain, launch_pdl=True)
    # The plan copy's fixed grid: one program in the interpreter (it loops over the chunks); on a GPU
    # one wave of programs (`plan_per_sm` a multiprocessor), but no more than the chunks a full plan of
    # the largest batch has (a small batch launches no program that can never have work).
    chunks = b * -(-k // plan_meta["EB"])
    programs = 1 if multiprocessors is None else min(chunks, tune.plan_per_sm * multiprocessors)
    # Behind the split resolver, layer 0's copy may read its likely misses while the resolver runs; the
    # resolver then writes the miss mask it reads (MASK), and lets it launch early where it has PDL.
    spec_meta: dict[str, Any] = {}
    if tune.spec_copy and split_shape is not None:
        spec_meta = shapes.spec_copy_meta(config, interpreted=cpu, entries=tune.spec_copy) | copy_meta
        if tune.pdl:
            spec_meta |= dict(PDL=chain, launch_pdl=True)
    return Launches(profile.max_rows, tune, shape, meta, fuse_meta, split_shape, split_rows, split_meta, tail_meta,
                    tail_warps, plan_meta, shapes.row_copy_meta(config, plan_meta), programs, spec_meta)


def scratch_shape(launches: list[Launches]) -> tuple[int, int, int, int]:
    """`(split programs, words of a counts row, tail programs, padded entries)` of the split scratch
    every profile can use: the largest of each (0 where no profile splits or spreads its tail)."""
    splits = [x.split_shape for x in launches if x.split_shape is not None]
    if not splits:
        return 0, 0, 0, 0
    tails = [s.hot_programs for s in splits if s.tail]
    return (max(s.split for s in splits), max(s.pw for s in splits), max(tails, default=0),
            max(s.gp * s.kp for s in splits))
