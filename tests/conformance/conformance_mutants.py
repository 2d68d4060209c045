"""Can the conformance suite fail? A copy of reference_cpu with one bug planted (a mutant) must fail it.

`python tests/conformance/conformance_mutants.py [NAME ...] [--jobs N] [--equivalent] [--list]` copies
`hisparse_reference_cpu` into a temporary folder as the backend `mutant` (its own distribution
metadata, so the registry finds it through the `hisparse.backends` entry point as it finds a
vendor's), plants one mutant, and runs `pytest --pyargs hisparse_conformance --hisparse-backend
mutant -x` in a child process, derandomized (hypothesis's `ci` profile, so a tree gives the same
verdicts on every run; `--random` draws fresh examples instead, as a vendor's run does). A mutant is *killed* when a test fails (exit status 1), *survives*
when the suite passes, and is an *error* on any other exit (the harness, not the suite, broke).
Exit status: 0 when every mutant run was killed, 1 otherwise.

`MUTANTS` are bugs a backend could ship: each breaks a clause of the resolver contract or of the
interfaces' docstrings. `EQUIVALENT` are changes the contract cannot see (each with the reason);
`--equivalent` runs them too, and they are expected to survive.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import hisparse_reference_cpu

SOURCE = Path(hisparse_reference_cpu.__file__).parent
PACKAGE = "hisparse_mutant"
BACKEND = "mutant"


@dataclass(frozen=True, slots=True)
class Mutant:
    """Replace `old` (which must occur exactly once in `file` of reference_cpu) with `new`."""

    name: str
    file: str
    old: str
    new: str
    breaks: str  # the clause it breaks (or, for an equivalent one, why nothing can see it)


_LRU = "torch.cat([evictable[m:], victims, hit_slots])"
_LRU_LINE = f"new_lru[q] = {_LRU}.to(torch.int32)"
_DEV_TO_HOST = "self._host[layer][host * bs:(host + 1) * bs] = self._dev[layer][dev * bs:(dev + 1) * bs]"
_HOST_TO_DEV = "self._dev[layer][dev * bs:(dev + 1) * bs] = self._host[layer][host * bs:(host + 1) * bs]"
_MIRROR = "self._host[layer][dst:dst + n] = self._dev[layer][src:src + n]"
_V_LRU = "new_lru[q] = torch.tensor(evictable[used:] + evictable[:used] + hit_slots, dtype=torch.int16)"
_V_CACHED = "cached = dgi_row[slot] if 0 <= slot < region_stride else -1"

MUTANTS: tuple[Mutant, ...] = (
    # the resolver (resolver.py)
    Mutant("lru_hits_first", "resolver.py", _LRU, "torch.cat([hit_slots, evictable[m:], victims])",
           "hits move to the most recent end of the LRU order"),
    Mutant("lru_victims_first", "resolver.py", _LRU, "torch.cat([victims, evictable[m:], hit_slots])",
           "victims move behind the untouched slots"),
    Mutant("victim_most_recent", "resolver.py", "victims = evictable[:m]", "victims = evictable.flip(0)[:m]",
           "misses take the least recently used evictable slots"),
    Mutant("lru_untouched", "resolver.py", _LRU_LINE, "new_lru[q] = order.to(torch.int32)",
           "a group with host entries reorders its state row's LRU"),
    Mutant("resident_offset", "resolver.py", "out[is_res] = (res_block * bs + offset)[is_res]",
           "out[is_res] = (res_block * bs + torch.clamp(offset - 1, min=0))[is_res]",
           "a resident entry reads its own row of the page"),
    Mutant("context_inclusive", "resolver.py",
           "in_ctx = (t >= 0) & (t < seq_lens[grp.start:grp.stop, None].long())",
           "in_ctx = (t >= 0) & (t <= seq_lens[grp.start:grp.stop, None].long())",
           "a position at seq_len is out of context"),
    Mutant("null_source_loaded", "resolver.py", "is_host = in_ctx & ~is_res & (src_block >= 0)",
           "is_host = in_ctx & ~is_res", "a null source page resolves to -1"),
    Mutant("plan_owner_last_row", "resolver.py", "first_batch_row = flat_idx[first] // k",
           "first_batch_row = torch.full_like(flat_idx[first] // k, grp.stop - grp.start - 1)",
           "a miss is planned in the row that first referenced it"),
    Mutant("valid_counts_all", "resolver.py", "valid_counts = (rows != -1).sum(dim=1)",
           "valid_counts = (rows >= -1).sum(dim=1)", "valid counts count resolved entries only"),
    Mutant("hits_count_misses", "resolver.py", "hits += union.numel() - m", "hits += union.numel()",
           "the hit counter counts distinct hot hits"),
    Mutant("repeats_load_twice", "resolver.py", "union, first = _first_reference_unique(entry_rows)",
           "union, first = entry_rows, torch.arange(entry_rows.numel())",
           "a row referenced several times in a group is loaded once"),
    # the runtime's copies and hot state (runtime.py)
    Mutant("plan_copy_short", "runtime.py",
           "used = torch.arange(plan_host.shape[1])[None, :] < plan_counts[:, None]",
           "used = torch.arange(plan_host.shape[1])[None, :] < (plan_counts[:, None] - 1)",
           "every planned miss is copied"),
    Mutant("replay_skips_last_layer", "runtime.py", "chosen = list(range(1, n)) if layers is None",
           "chosen = list(range(1, n - 1)) if layers is None", "replay_plan() copies into every follower"),
    Mutant("replay_empty_is_every_follower", "runtime.py", "chosen = list(range(1, n)) if layers is None",
           "chosen = list(range(1, n)) if not layers", "replay_plan([]) copies nothing"),
    Mutant("invalidate_nothing", "runtime.py", "self._hot_map[q][self._hot_map[q] == g] = -1", "pass",
           "invalidate_written_slots empties the slot holding a written row"),
    Mutant("invalidate_first_pair", "runtime.py",
           "for q, g in zip(states[live].tolist(), rows[live].tolist(), strict=False):",
           "for q, g in list(zip(states[live].tolist(), rows[live].tolist(), strict=False))[:1]:",
           "every (state row, host row) pair is invalidated"),
    Mutant("mirror_short", "runtime.py", _MIRROR,
           "self._host[layer][dst:dst + n - 1] = self._dev[layer][src:src + n - 1]", "a mirror copies all its rows"),
    Mutant("mirror_layer_zero", "runtime.py", f"for layer in range(self.config.num_layers):\n                {_MIRROR}",
           f"for layer in range(1):\n                {_MIRROR}", "a mirror copies every layer"),
    Mutant("spill_short", "runtime.py", _DEV_TO_HOST,
           "self._host[layer][host * bs:(host + 1) * bs - 1] = self._dev[layer][dev * bs:(dev + 1) * bs - 1]",
           "a spill copies the whole page"),
    Mutant("restore_short", "runtime.py", _HOST_TO_DEV,
           "self._dev[layer][dev * bs + 1:(dev + 1) * bs] = self._host[layer][host * bs + 1:(host + 1) * bs]",
           "a restore copies the whole page"),
    Mutant("host_copy_nothing", "runtime.py",
           "self._host[layer][dst * bs:(dst + 1) * bs] = self._host[layer][src * bs:(src + 1) * bs]", "pass",
           "copy_host_blocks copies the block"),
    Mutant("invalidate_blocks_nothing", "runtime.py", "self._hot_map[stale] = -1", "pass",
           "invalidate_host_blocks forgets hot copies of the blocks"),
    Mutant("reset_keeps_lru", "runtime.py",
           "self._lru[q] = torch.arange(self.config.hot_rows, dtype=torch.int32)", "pass",
           "reset_state restores the initial LRU order"),
    Mutant("h2d_not_counted", "runtime.py",
           "self._count(h2d_bytes=src.numel() * self.config.row_format.row_bytes)", "self._count(h2d_bytes=0)",
           "the h2d counter counts the miss copies"),
    Mutant("replay_dedups_layers", "runtime.py",
           'chosen = list(range(1, n)) if layers is None else check_ints("layers", layers, 0, n)',
           'chosen = list(range(1, n)) if layers is None else sorted(set(check_ints("layers", layers, 0, n)))',
           "replay_plan(layers) copies and counts each layer listed, a repeated one or 0 included"),
    Mutant("prefetch_validates", "runtime.py", "    @property\n    def result(self) -> ResolveResult:",
           "    def prefetch(self, inputs: ResolveInputs) -> None:\n        self.resolve(inputs, gather=True)\n"
           "        if self.config.num_layers > 1:\n            self.replay_plan()\n\n"
           "    @property\n    def result(self) -> ResolveResult:",
           "prefetch is resolve(validate=False): it masks out-of-context positions instead of raising"),
    # vLLM's op set (vllm_ops.py)
    Mutant("vllm_lru_order", "vllm_ops.py", _V_LRU,
           "new_lru[q] = torch.tensor(evictable[:used] + evictable[used:] + hit_slots, dtype=torch.int16)",
           "vLLM's LRU order after a resolve"),
    Mutant("vllm_miss_mask_unwritten", "vllm_ops.py", "                        mm[first[gv]] = 1\n", "",
           "miss_mask marks each miss's first reference"),
    Mutant("vllm_padding_zero", "vllm_ops.py", "hot_out.copy_(torch.where(pad, -1, out).to(torch.int32))",
           "hot_out.copy_(torch.where(pad, 0, out).to(torch.int32))", "padding rows publish -1"),
    Mutant("vllm_compact_clamp", "vllm_ops.py", "count = miss_counts[:n].long().clamp(0, k)",
           "count = miss_counts[:n].long().clamp(0, k - 1)", "gather_compact clamps counts to top-k, not below"),
    Mutant("vllm_invalidate_one_copy", "vllm_ops.py", "dgi[q][dgi[q] == w] = -1",
           "dgi[q][(dgi[q] == w).nonzero()[:1]] = -1", "the invalidation clears every slot holding the row"),
    Mutant("vllm_misses_not_counted", "vllm_ops.py", "counters[1] += misses_total", "counters[1] += 0",
           "the stats output counts misses"),
    Mutant("vllm_out_of_range_slot_wraps", "vllm_ops.py", _V_CACHED, "cached = dgi_row[slot % len(dgi_row)]",
           "an out-of-range LRU slot is never read"),
    Mutant("vllm_out_of_range_victim_wraps", "vllm_ops.py", "slot = evictable[m] if m < used else -1",
           "slot = (evictable[m] % region_stride) if m < used else -1",
           "an out-of-range victim slot degrades its miss to -1"),
    Mutant("vllm_gather_plan_unmasked", "vllm_ops.py", "take = ~padding[:, None] & (miss_mask != 0) & (src >= 0)",
           "take = ~padding[:, None] & (src >= 0)", "gather_plan copies only the entries its miss mask marks"),
    Mutant("vllm_padding_valid_counts", "vllm_ops.py",
           "valid_counts[:n] = torch.where(padding, 0, valid).to(torch.int32)",
           "valid_counts[:n] = valid.to(torch.int32)", "padding rows publish a valid count of 0"),
    # the transfer engine (transfer.py)
    Mutant("reader_skips_restores", "transfer.py", "                if t.restore:\n",
           "                if t.restore and self._pool.is_writer:\n",
           "every rank of a shared pool restores pages into its own device"),
    Mutant("repeated_id_accepted", "transfer.py",
           "        check_unique_ids(\"transfer id\", [t.transfer_id for t in transfers],\n"
           "                         {p.ident for p in self._pending if not p.host_copy})\n", "",
           "a transfer id still unacknowledged is refused"),
    Mutant("repeated_destination_accepted", "transfer.py",
           "        check_unique_ids(\"host copy destination block\", dsts, "
           "{p.ident for p in self._pending if p.host_copy})\n", "",
           "a host copy destination still unacknowledged is refused"),
    Mutant("completed_a_poll_early", "transfer.py",
           "done = [p for p in self._pending if self._polls - (p.enqueued_at or 0) >= self._lag]",
           "done = [p for p in self._pending if self._polls - (p.enqueued_at or 0) >= self._lag - 1]",
           "a transfer is completed only after it was reported enqueued"),
    Mutant("mirrors_checked_per_runtime", "transfer.py",
           "        for rt in self._runtimes:\n            rt.check_mirrors(mirrors)\n", "",
           "a mirror one runtime refuses changes nothing on any runtime"),
    Mutant("pages_checked_per_runtime", "transfer.py",
           "        for rt in self._runtimes:\n            rt.check_pages(transfers, restore=None)\n", "",
           "a page transfer one runtime refuses changes nothing on any runtime"),
)

EQUIVALENT: tuple[Mutant, ...] = (
    Mutant("plan_rows_unchecked", "runtime.py",
           "        if gather:\n            self._check_plan_rows(res.plan_host, res.plan_device, res.plan_counts)\n\n",
           "\n", "a plan row outside the bound storage only comes from out-of-range values under "
           "validate=False, which the contract leaves undefined"),
    Mutant("vllm_slot_bound_by_width", "vllm_ops.py", _V_CACHED,
           "cached = dgi_row[slot] if 0 <= slot < len(dgi_row) else -1",
           "the op's argument check requires region_stride to equal the hot map's width"),
)


@dataclass(frozen=True, slots=True)
class Outcome:
    mutant: Mutant
    status: str  # "killed", "survived" or "error"
    seconds: float
    detail: str  # the first failing test, or the tail of the output


def check_anchors(mutants: tuple[Mutant, ...] = MUTANTS + EQUIVALENT) -> list[str]:
    """Each mutant's `old` text occurs exactly once in its reference_cpu file; the problems found."""
    problems = []
    for m in mutants:
        count = (SOURCE / m.file).read_text().count(m.old)
        if count != 1:
            problems.append(f"{m.name}: {m.file} holds its text {count} times; expected once")
    return problems


def build(root: Path, mutant: Mutant) -> Path:
    """The folder to put on PYTHONPATH: reference_cpu renamed, `mutant` planted."""
    package = root / PACKAGE
    shutil.copytree(SOURCE, package, ignore=shutil.ignore_patterns("__pycache__"))
    for path in package.glob("*.py"):
        text = path.read_text().replace("hisparse_reference_cpu", PACKAGE)
        if path.name == "plugin.py":
            text = text.replace('NAME = "reference_cpu"', f'NAME = "{BACKEND}"').replace("priority=0", "priority=-100")
        if path.name == "backend.py":
            text = text.replace('name: ClassVar[str] = "reference_cpu"', f'name: ClassVar[str] = "{BACKEND}"')
        if path.name == mutant.file:
            text = text.replace(mutant.old, mutant.new)
        path.write_text(text)
    meta = root / f"{PACKAGE}-0.0.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 0.0.0\n")
    (meta / "entry_points.txt").write_text(f"[hisparse.backends]\n{BACKEND} = {PACKAGE}.plugin\n")
    return root


def run(mutant: Mutant, *, randomized: bool = False, timeout_s: float = 900.0) -> Outcome:
    """Run the whole suite, stopping at the first failure, against `mutant` planted in a fresh copy."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hisparse-mutant-") as tmp:
        site = build(Path(tmp), mutant)
        # The child chooses its backend by the flag alone: no HISPARSE_* or PYTEST_* setting of ours.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HISPARSE_", "PYTEST_"))}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        profile = [] if randomized else ["--hypothesis-profile=ci"]
        proc = subprocess.run([sys.executable, "-m", "pytest", *profile, "--pyargs", "hisparse_conformance",
                               "--hisparse-backend", BACKEND, "-x", "-q", "-p", "no:cacheprovider"], cwd=tmp, env=env,
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    out = proc.stdout + proc.stderr
    failed = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    status = {1: "killed", 0: "survived"}.get(proc.returncode, "error")
    detail = failed[0][:160] if failed else out.strip().splitlines()[-1][:160] if out.strip() else ""
    return Outcome(mutant, status, time.monotonic() - t0, detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: every one of MUTANTS)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--equivalent", action="store_true", help="also run EQUIVALENT (expected to survive)")
    parser.add_argument("--random", action="store_true", help="fresh hypothesis examples (default: derandomized)")
    parser.add_argument("--list", action="store_true", help="print the mutants and what each breaks, then exit")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTANTS + EQUIVALENT}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutant {unknown[0]!r}; expected one of: {', '.join(known)}")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: expected a whole number of at least 1")
    problems = check_anchors()
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    chosen = [known[n] for n in args.names] or list(MUTANTS) + (list(EQUIVALENT) if args.equivalent else [])
    if args.list:
        for m in chosen:
            print(f"{m.name:32s} {m.file:12s} {m.breaks}")
        return 0
    draws = "fresh examples" if args.random else "derandomized"
    print(f"{len(chosen)} mutants of reference_cpu against the conformance suite ({draws}), {args.jobs} at a time",
          flush=True)
    expected = {m.name: "survived" if m in EQUIVALENT else "killed" for m in chosen}
    bad = 0
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for o in pool.map(lambda m: run(m, randomized=args.random), chosen):
            ok = o.status == expected[o.mutant.name]
            bad += not ok
            print(f"{o.mutant.name:32s} {o.status:8s} {o.seconds:6.1f} s  {'' if ok else 'UNEXPECTED  '}{o.detail}",
                  flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} as expected" + ("" if not bad else f"; {bad} not"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
