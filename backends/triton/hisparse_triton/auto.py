"""The triton runtime's default knobs per call shape (`HISPARSE_TRITON_AUTO`, on by default).

A runtime serves batches of 1 to `max_batch_rows` rows, and a captured step's batch size is fixed,
so the knobs of `shapes.tuning` can differ by batch size the way the nvidia backend's resolver build
does by shape: the runtime keeps one set of launches per profile (`Profile`) and picks it from the
call's row count on the host, with no device read. Each `HISPARSE_TRITON_*` variable set explicitly
wins over the auto choice at every batch size; an auto pick is left out where it does not combine
with the explicit settings (the same refusal rules as `shapes.tuning`) or where the target lacks it
(PDL is NVIDIA sm_90 and later only). `HISPARSE_TRITON_AUTO=0` keeps the fixed defaults of before.

What is picked, from the H200 (docs/gpu-validation.md, "Sixteenth session" C4, and the seventeenth
session's call D1, which timed the fixed defaults, `gather:s1:b1:v1` and the small-batch pick side by
side on 16 cells): at batches whose split programs fit one wave of the multiprocessors, the split
resolver at 512 threads with two-level scans, shift-and-mask blocks, the lean plan copy as a
programmatic dependent launch, 4 plan entries a chunk and 4 copy programs a multiprocessor (faster
than both others on every miss and hit cell at B = 1 and 8 but 274 misses B = 8, where it tied
`s1:b1:v1`; 0.6 us slower on resident steps); larger batches keep the one-program resolver with
two-level scans, shift-and-mask blocks and the lean copy (the fastest at B = 64 in every cell; at B =
128 faster on hit and 2048-miss steps, 21 us slower than the fixed defaults at 274 misses, one sample).
Batches from half that line up to it add the speculative layer-0 copy of 128 entries a program
(`shapes.SPEC_COPY_ENV`; the eighteenth session's call E5 timed it against the same profile without
it at B = 1-32: at B = 8 and 16 it brought 274 misses from 52.0 and 81.9 us to 44.1 and 69.5 and 2048
misses from 287.5 and 512.5 to 267.9 and 491.6, and cost 1.4-4.2 us on resident and hit steps; at B = 2
and 4 it lost at 274 misses, 33.1 and 36.5 against 27.4 and 35.4, and at B = 1 on every cell but 2048
misses). So a runtime has up to three profiles: below half the line, half the line up to it, and
larger.
Imports no torch or triton.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hisparse_core.errors import InvalidInputError
from hisparse_triton import shapes
from hisparse_triton.shapes import Tuning

AUTO_ENV = "HISPARSE_TRITON_AUTO"
#: The target `check_target`'s refusals name under Triton's interpreter.
INTERPRETER = "the interpreter (cpu)"
#: Every variable `shapes.tuning` reads (an explicit one wins over the auto choice).
KNOB_ENVS = (shapes.RESOLVER_ENV, shapes.THREADS_ENV, shapes.PLAN_PER_SM_ENV, shapes.FUSE_ENV, shapes.LEAN_ENV,
             shapes.PLAN_ENTRIES_ENV, shapes.CAS_ENV, shapes.SCAN_ENV, shapes.SHIFT_ENV, shapes.ROW_COPY_ENV,
             shapes.PDL_ENV, shapes.SPLIT_ENV, shapes.SPLIT_TAIL_ENV, shapes.LEAN_COPY_ENV, shapes.SPLIT_KEEP_ENV,
             shapes.SPEC_COPY_ENV, shapes.PDL_CHAIN_ENV)
#: The split resolver's programs a batch row at small batches; "small" is where they fit one wave.
AUTO_SPLIT = 8
#: Picks at small batches, in order (a pick joins only if the settings so far plus it pass `shapes.tuning`).
SMALL_PICKS: tuple[tuple[str, str], ...] = (
    (shapes.SPLIT_ENV, str(AUTO_SPLIT)), (shapes.THREADS_ENV, "512"), (shapes.SCAN_ENV, "1"), (shapes.SHIFT_ENV, "1"),
    (shapes.LEAN_COPY_ENV, "1"), (shapes.PDL_ENV, "1"), (shapes.PLAN_ENTRIES_ENV, "4"), (shapes.PLAN_PER_SM_ENV, "4"))
SMALL_WHY = ("H200 calls C4 and D1 (seventeenth session): 34 misses B = 8 1.69-1.70x nvidia where the fixed defaults took 2.17-2.21x, "
             "274 misses 1.46-1.56x (1.68x), hits 1.55-1.83x, resident 0.6 us slower")
#: Picked at batches from `spec_rows(small)` rows up to the small line, after `SMALL_PICKS` (where the split resolver joined).
SPEC_PICKS: tuple[tuple[str, str], ...] = ((shapes.SPEC_COPY_ENV, "128"),)
SPEC_WHY = ("as the smaller batches plus the speculative layer-0 copy: H200 call E5 (eighteenth session), at B = 8 and 16 "
            "274 misses 52.0 -> 44.1 and 81.9 -> 69.5 us, 2048 misses 287.5 -> 267.9 and 512.5 -> 491.6, resident and hit "
            "steps 1.4-4.2 us slower; not below half the small line, where it lost at 274 misses (B = 2: 33.1 against 27.4)")
#: Picks at larger batches.
LARGE_PICKS: tuple[tuple[str, str], ...] = (
    (shapes.SCAN_ENV, "1"), (shapes.SHIFT_ENV, "1"), (shapes.LEAN_COPY_ENV, "1"))
LARGE_WHY = ("H200 call D1 (seventeenth session): the fastest of the three timed at B = 64 in every cell (274 misses 264.6 us, the fixed "
             "defaults 279.6; 2048 misses 1856.9, 1958.9); at B = 128 PDL lost 78-93 us at 274 misses (D1, K4)")
#: Bench suffixes (`bench/bench_triton.py --variants`) of each knob, in the bench's order.
SUFFIXES = ((shapes.THREADS_ENV, "t"), (shapes.PLAN_PER_SM_ENV, "p"), (shapes.FUSE_ENV, "f"), (shapes.LEAN_ENV, "l"),
            (shapes.PLAN_ENTRIES_ENV, "e"), (shapes.CAS_ENV, "c"), (shapes.SCAN_ENV, "s"), (shapes.SHIFT_ENV, "b"),
            (shapes.ROW_COPY_ENV, "r"), (shapes.PDL_ENV, "d"), (shapes.SPLIT_ENV, "n"), (shapes.SPLIT_TAIL_ENV, "h"),
            (shapes.LEAN_COPY_ENV, "v"), (shapes.SPLIT_KEEP_ENV, "k"), (shapes.SPEC_COPY_ENV, "x"),
            (shapes.PDL_CHAIN_ENV, "w"))


@dataclass(frozen=True, slots=True)
class Profile:
    """The knobs of batches of more rows than the previous profile's `max_rows`, up to `max_rows`."""

    max_rows: int
    tuning: Tuning
    picked: tuple[str, ...]  # the variables the auto choice set


@dataclass(frozen=True, slots=True)
class Choice:
    profiles: tuple[Profile, ...]
    line: str  # what was chosen and why, one line for the log

    def profile(self, rows: int) -> Profile:
        """The profile of a batch of `rows` rows (the last one past every bound)."""
        return next((p for p in self.profiles if rows <= p.max_rows), self.profiles[-1])


def small_rows(multiprocessors: int | None, max_batch_rows: int) -> int:
    """The largest batch auto treats as small: `AUTO_SPLIT` programs a row in one wave of
    `multiprocessors` (None, the interpreter: half the workspace, the split resolver's own line there,
    so that tests run both profiles on one state)."""
    if multiprocessors is None:
        return max(1, max_batch_rows // 2)
    return max(1, multiprocessors // AUTO_SPLIT)


def spec_rows(small: int) -> int:
    """The smallest batch given the speculative copy: half the small line (8 rows on the H200), and
    never 1 row."""
    return max(2, small // 2)


def auto_enabled(env: Mapping[str, str]) -> bool:
    value = env.get(AUTO_ENV) or "1"
    if value not in ("0", "1"):
        raise InvalidInputError(f"{AUTO_ENV}={value!r} is not a switch; expected 0 (the fixed defaults) or 1 "
                                f"(knobs per batch size, the default)")
    return value == "1"


def variant(t: Tuning) -> str:
    """`t` as a `bench_triton.py` variant string (only what differs from the fixed defaults)."""
    base = shapes.tuning({})
    parts = [t.resolver]
    values = {shapes.THREADS_ENV: (t.threads, base.threads), shapes.PLAN_PER_SM_ENV: (t.plan_per_sm, base.plan_per_sm),
              shapes.FUSE_ENV: (t.fuse, base.fuse), shapes.LEAN_ENV: (t.lean, base.lean),
              shapes.PLAN_ENTRIES_ENV: (t.plan_entries, base.plan_entries), shapes.CAS_ENV: (t.cas, base.cas),
              shapes.SCAN_ENV: (t.scan, base.scan), shapes.SHIFT_ENV: (t.shift, base.shift),
              shapes.ROW_COPY_ENV: (t.row_copy, base.row_copy), shapes.PDL_ENV: (t.pdl, base.pdl),
              shapes.SPLIT_ENV: (t.split, base.split), shapes.SPLIT_TAIL_ENV: (t.split_tail, base.split_tail),
              shapes.LEAN_COPY_ENV: (t.lean_copy, base.lean_copy),
              shapes.SPLIT_KEEP_ENV: (t.split_keep, base.split_keep),
              shapes.SPEC_COPY_ENV: (t.spec_copy, base.spec_copy),
              shapes.PDL_CHAIN_ENV: (t.pdl_chain, base.pdl_chain)}
    for key, suffix in SUFFIXES:
        value, default = values[key]
        if value != default:
            parts.append(f"{suffix}{int(value) if isinstance(value, bool) else value}")
    return ":".join(parts)


def _merge(explicit: dict[str, str], picks: tuple[tuple[str, str], ...], *, pdl: bool) -> tuple[Tuning, tuple[str, ...]]:
    settings = dict(explicit)
    picked = []
    for key, value in picks:
        if key in explicit or (key == shapes.PDL_ENV and not pdl):
            continue
        if key in (shapes.THREADS_ENV, shapes.SPEC_COPY_ENV) and settings.get(shapes.SPLIT_ENV, "0") == "0":
            continue  # 512 threads were timed with the split resolver only; the speculative copy runs behind it only
        try:
            shapes.tuning(settings | {key: value})
        except InvalidInputError:
            continue  # does not combine with an explicit setting
        settings[key] = value
        picked.append(key)
    return shapes.tuning(settings), tuple(picked)


def _rows(lo: int, hi: int) -> str:
    return f"{lo} row" if lo == hi == 1 else f"{lo} rows" if lo == hi else f"{lo}-{hi} rows"


def choose(env: Mapping[str, str], *, max_batch_rows: int, small: int, pdl: bool) -> Choice:
    """The profiles of a runtime of `max_batch_rows` rows under `env`: batches below `spec_rows(small)`
    rows, from it up to `small` rows, and the rest, each with the explicit settings of `env` and the auto picks that combine
    with them (neighbouring ranges of equal knobs are one profile; a range past `max_batch_rows`, or the
    middle one where `small` < 2, has none); `pdl`: whether the target has programmatic dependent launch.
    One clear error per bad value (the explicit settings are checked as `shapes.tuning` checks them,
    before any pick)."""
    explicit = {k: env[k] for k in KNOB_ENVS if env.get(k)}
    base = shapes.tuning(explicit)
    if not auto_enabled(env):
        if base.spec_copy and not base.split:
            raise InvalidInputError(f"{shapes.SPEC_COPY_ENV}={explicit[shapes.SPEC_COPY_ENV]!r} follows the split "
                                    f"resolver, which no batch size takes here ({AUTO_ENV}=0, {shapes.SPLIT_ENV} unset "
                                    f"or 0); expected {shapes.SPEC_COPY_ENV}=0 or {shapes.SPLIT_ENV} set")
        if base.pdl_chain and not (base.split and base.pdl):
            raise InvalidInputError(f"{shapes.PDL_CHAIN_ENV}={explicit[shapes.PDL_CHAIN_ENV]!r} chains the split "
                                    f"resolver's programmatic dependent launches ({AUTO_ENV}=0: nothing picked); "
                                    f"expected {shapes.SPLIT_ENV} and {shapes.PDL_ENV}=1 set, or {shapes.PDL_CHAIN_ENV}=0")
        return Choice((Profile(max_batch_rows, base, ()),),
                      f"triton tuning: {AUTO_ENV}=0, every batch {variant(base)} (the fixed defaults and the "
                      f"explicit settings)")
    one, one_picked = _merge(explicit, SMALL_PICKS, pdl=pdl)
    mid, mid_picked = _merge(explicit, SMALL_PICKS + SPEC_PICKS, pdl=pdl)
    hi, hi_picked = _merge(explicit, LARGE_PICKS, pdl=pdl)
    # (last row, knobs, picks, why) of each range; a range merges into the one before it where their knobs are equal.
    ranges: list[tuple[int, Tuning, tuple[str, ...], str]] = []
    bounds = (min(spec_rows(small) - 1, max_batch_rows), min(small, max_batch_rows), max_batch_rows)
    for last, tuning, picked, why in zip(bounds, (one, mid, hi), (one_picked, mid_picked, hi_picked),
                                         (SMALL_WHY, SPEC_WHY, LARGE_WHY), strict=True):
        if ranges and last <= ranges[-1][0]:
            continue  # empty: past the workspace, or no batch between `spec_rows(small)` and `small`
        if ranges and ranges[-1][1] == tuning:
            ranges[-1] = (last, *ranges[-1][1:])
        else:
            ranges.append((last, tuning, picked, why))
    profiles = tuple(Profile(last, t, picked) for last, t, picked, _ in ranges)
    if len(ranges) == 1:
        where = f"every batch ({_rows(1, max_batch_rows)}) {variant(ranges[0][1])} ({SMALL_WHY})"
    else:
        firsts = [1] + [last + 1 for last, *_ in ranges[:-1]]
        where = "batches of " + "; ".join(f"{_rows(f, last)} {variant(t)} ({why})"
                                          for f, (last, t, _, why) in zip(firsts, ranges, strict=True))
    if base.pdl_chain and not any(p.tuning.split and p.tuning.pdl and not p.tuning.split_tail for p in profiles):
        raise InvalidInputError(f"{shapes.PDL_CHAIN_ENV}={explicit[shapes.PDL_CHAIN_ENV]!r} chains the split resolver's "
                                f"programmatic dependent launches, which no batch size takes here ({shapes.SPLIT_ENV} "
                                f"and {shapes.PDL_ENV} at no batch size together); expected {shapes.PDL_CHAIN_ENV}=0")
    if base.spec_copy and not any(p.tuning.split for p in profiles):
        raise InvalidInputError(f"{shapes.SPEC_COPY_ENV}={explicit[shapes.SPEC_COPY_ENV]!r} follows the split resolver, "
                                f"which no batch size takes here ({shapes.SPLIT_ENV} unset or 0 at every batch); "
                                f"expected {shapes.SPEC_COPY_ENV}=0 or {shapes.SPLIT_ENV} set")
    notes = []
    if explicit:
        notes.append("set explicitly: " + ", ".join(f"{k}={v}" for k, v in explicit.items()))
    if not pdl and shapes.PDL_ENV not in explicit:
        notes.append(f"{shapes.PDL_ENV} not picked (no NVIDIA GPU of compute capability 9.0 or later here)")
    return Choice(profiles, f"triton tuning: {AUTO_ENV}=1, {where}" + "".join(f"; {n}" for n in notes))


def check_target(tune: Tuning, *, pdl: bool, found: Callable[[], str], rocm_triton: str | None = None) -> None:
    """Refuse explicit settings (`tune`, `shapes.tuning`) the target cannot run: `shapes.CAS_ENV` where
    the target is ROCm (`rocm_triton`, its Triton version; None elsewhere) and that Triton cannot compile
    it; `shapes.PDL_ENV` and `shapes.PDL_CHAIN_ENV` without programmatic dependent launch (`pdl`; `found`
    names the target, asked only for the message)."""
    if tune.cas and rocm_triton is not None and not shapes.cas_compiles(rocm_triton, rocm=True):
        raise InvalidInputError(f"{shapes.CAS_ENV}='1' needs Triton {'.'.join(map(str, shapes.CAS_MIN_TRITON_ROCM))} "
                                f"or later on ROCm; found Triton {rocm_triton}")
    for key, on in ((shapes.PDL_ENV, tune.pdl), (shapes.PDL_CHAIN_ENV, tune.pdl_chain)):
        if on and not pdl:
            raise InvalidInputError(f"{key}='1' needs an NVIDIA GPU of compute capability 9.0 or later "
                                    f"(programmatic dependent launch); found {found()}")


def check(env: Mapping[str, str], *, pdl: bool, found: Callable[[], str], rocm_triton: str | None = None) -> Tuning:
    """Every refusal a runtime's construction makes of `env` without a workspace size, in its order:
    `shapes.tuning`, `check_target`, then `choose`'s (`AUTO_ENV` and the rules across variables). The
    backend's `check_settings` calls it with what it knows without a device (`pdl` True where only the
    device can tell: the runtime checks again). `choose` is asked for one batch row: its first profile,
    the one such a runtime has, exists at every size and holds every split resolver and PDL launch that a
    larger size's profiles hold (the picks of larger batches are a subset), so it refuses exactly what
    every size refuses."""
    tune = shapes.tuning(dict(env))
    check_target(tune, pdl=pdl, found=found, rocm_triton=rocm_triton)
    choose(env, max_batch_rows=1, small=small_rows(None, 1), pdl=pdl)
    return tune
