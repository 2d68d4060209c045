"""Capacity arithmetic shared by `hisparse plan` and `hisparse run`.

GPU memory model (the one the replay engine implements, after vLLM's HMA pool):

- One GPU block holds `block_size` tokens of every sparse layer: `block_bytes = block_size *
  num_layers * row_bytes`. Resident pages and hot-buffer pages are such blocks (a hot block gives
  every index group its hot rows in its own layers, so one lease serves all groups).
- Indexer keys never leave the GPU. A request's indexer keys for its whole context are charged
  to the same pool in whole blocks: `ceil(pages * block_size * index_layers * indexer_bytes /
  block_bytes)`.
- Without hisparse a request holds every page plus its indexer blocks.
- Hybrid rule: a request whose context fits its hot buffer and active tail (`context <=
  resident_context`: `hot_rows + tail_pages * block_size`) stays resident, exactly as without
  hisparse: it never leases a hot buffer (which with the tail it keeps would cost at least as
  many blocks as releasing its pages frees) and never misses. The coordinator's residency policy
  releases no page of such a request, so hisparse never runs fewer requests than all-resident
  there (less only where the host pool binds), and the crossover where hisparse starts to pay
  (`crossover_context`) lies past it: where the steady state below, with one admission kept
  free, fits more requests than all-resident.
- With hisparse a running request holds its indexer blocks, its hot buffer (`hot_rows /
  block_size` blocks) and its `tail_pages` newest pages. Admitting one more request needs one
  full admission free: all of its pages, its indexer blocks and its hot buffer (the
  coordinator's pressure watermark keeps that much free by releasing clean pages). So the
  largest concurrency is `1 + floor((gpu_blocks - admission) / steady)` when one admission fits.
- Host: every page of every request has a host block; block 0 is the null block. Host
  concurrency is `floor((host_blocks - 1) / pages)`; hisparse concurrency is the smaller of the
  GPU and host figures.

PCIe per decode step: every index group looks up `top_k` positions per request; a miss rate `m`
(misses per looked-up entry; 0 for a request that stays resident) copies `m * top_k` rows into each layer of the group, so a request
costs `m * top_k * num_layers * row_bytes` host-to-device, and mirroring its new token costs
`num_layers * row_bytes` device-to-host.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, replace
from fractions import Fraction

from hisparse_core.errors import InvalidInputError

#: ACTIVE_TAIL_PAGES upstream: the newest pages of a running request stay resident.
DEFAULT_TAIL_PAGES = 2

#: Published LRU miss rates at top-k 2048 (HiSparse paper, GLM-5.1 / LongBenchV2), by hot-buffer
#: multiple of top-k; `published_miss_rate` interpolates between them (log-log).
PUBLISHED_LRU_MISS = {1.0: 0.30, 2.0: 0.134, 4.0: 0.067}


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """What capacity depends on. `num_layers` are the sparse-MLA layers whose KV hisparse
    offloads; `index_share` layers share one indexer (IndexShare frequency)."""

    name: str
    num_layers: int
    row_bytes: int
    indexer_bytes: int
    top_k: int
    block_size: int
    index_share: int = 1
    note: str = ""

    def __post_init__(self) -> None:
        for f in ("num_layers", "row_bytes", "top_k", "block_size", "index_share"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidInputError(f"model geometry {f} must be a positive int, got {v!r}")
        if self.indexer_bytes < 0:
            raise InvalidInputError(f"model geometry indexer_bytes must be >= 0, got {self.indexer_bytes}")

    @property
    def index_layers(self) -> int:
        return math.ceil(self.num_layers / self.index_share)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.num_layers * self.row_bytes


#: Built-in geometries. Rows: FP8 "ds_mla" 656 B (512 B FP8 NoPE + 16 B scales + 128 B RoPE);
#: indexer keys 132 B (128 FP8 + fp32 scale); DSA top-k 2048; FlashMLA page 64.
MODELS: dict[str, ModelGeometry] = {
    "deepseek-v3.2": ModelGeometry("deepseek-v3.2", 61, 656, 132, 2048, 64, 1,
                                   "61 MLA layers, one indexer per layer"),
    "glm-5.1": ModelGeometry("glm-5.1", 78, 656, 132, 2048, 64, 1,
                             "GLM-5 / 5.1: 78 MLA layers, one indexer per layer"),
    "glm-5.2": ModelGeometry("glm-5.2", 78, 656, 132, 2048, 64, 4,
                             "78 MLA layers, IndexShare: one indexer per 4 layers (index_topk_freq 4)"),
}

#: transformers' model types, accepted wherever a model name is (`plan --model`, `generate --model`).
MODEL_ALIASES: dict[str, str] = {"deepseek_v32": "deepseek-v3.2", "glm_moe_dsa": "glm-5.2"}

#: The transformers model type of each built-in model (what `hisparse generate` builds a tiny one of).
MODEL_TYPES: dict[str, str] = {"deepseek-v3.2": "deepseek_v32", "glm-5.1": "glm_moe_dsa", "glm-5.2": "glm_moe_dsa"}


def model_name(text: str) -> str:
    """A built-in model's name for `text`, which may be an alias (`MODEL_ALIASES`); anything else
    comes back as given, for the caller's list of choices to refuse."""
    key = text.strip().lower()
    return MODEL_ALIASES.get(key, key if key in MODELS else text)


def aliases_text() -> str:
    """The aliases, for help texts: "deepseek_v32 = deepseek-v3.2, glm_moe_dsa = glm-5.2"."""
    return ", ".join(f"{alias} = {name}" for alias, name in MODEL_ALIASES.items())


def published_miss_rate(hot_multiple: float) -> float:
    """The published LRU miss rate at this hot-buffer multiple of top-k (log-log interpolation
    between 1x, 2x and 4x; extrapolated along the 2x-4x slope beyond 4x, flat below 1x)."""
    if hot_multiple <= 1.0:
        return PUBLISHED_LRU_MISS[1.0]
    pts = sorted(PUBLISHED_LRU_MISS.items())
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):  # noqa: B007 - the segment is read after the loop
        if hot_multiple <= x1:
            break
    t = (math.log(hot_multiple) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


@dataclass(frozen=True, slots=True)
class PlanInputs:
    geometry: ModelGeometry
    gpu_kv_bytes: int
    host_bytes: int
    context: int
    hot_rows: int
    miss_rate: float
    tail_pages: int = DEFAULT_TAIL_PAGES
    pcie_gbps: float = 50.0

    def __post_init__(self) -> None:
        g = self.geometry
        if self.gpu_kv_bytes <= 0 or self.host_bytes < 0:
            raise InvalidInputError(f"GPU KV memory must be > 0 and host memory >= 0 bytes, got "
                                    f"{self.gpu_kv_bytes} and {self.host_bytes}")
        if self.context <= 0:
            raise InvalidInputError(f"context must be > 0 tokens, got {self.context}")
        if self.hot_rows < g.top_k or self.hot_rows % g.block_size:
            raise InvalidInputError(f"hot buffer of {self.hot_rows} rows must be >= top-k {g.top_k} and a multiple "
                                    f"of block size {g.block_size}")
        if not 0.0 <= self.miss_rate <= 1.0:
            raise InvalidInputError(f"miss rate must be in [0, 1], got {self.miss_rate}")
        if self.tail_pages < 1:
            raise InvalidInputError(f"tail pages must be >= 1, got {self.tail_pages}")
        if not self.pcie_gbps > 0:
            raise InvalidInputError(f"PCIe bandwidth must be > 0 GB/s, got {self.pcie_gbps}")


@dataclass(frozen=True, slots=True)
class Plan:
    """Every figure of a capacity plan (blocks are GPU blocks of `block_bytes` unless named host)."""

    inputs: PlanInputs
    pages_per_request: int
    gpu_blocks: int
    block_bytes: int
    indexer_blocks_per_request: int
    baseline_blocks_per_request: int
    baseline_concurrency: int
    hot_blocks_per_request: int
    steady_blocks_per_request: int
    admission_blocks: int
    #: The hybrid rule: the context fits the hot buffer and tail, so requests stay all resident
    #: (no hot buffer leased, no misses) and hisparse only mirrors them to host.
    stays_resident: bool
    #: Misses per looked-up entry charged to PCIe: the input's, or 0 when requests stay resident.
    miss_rate: float
    gpu_concurrency: int
    host_block_bytes: int
    host_blocks: int
    host_concurrency: int
    hisparse_concurrency: int
    host_pool_bytes_needed: int
    h2d_bytes_per_request_step: float
    d2h_bytes_per_request_step: int
    h2d_bytes_per_step: float
    d2h_bytes_per_step: int
    pcie_ms_per_step: float

    @property
    def bound_by(self) -> str:
        return "host pool" if self.host_concurrency < self.gpu_concurrency else "GPU"

    @property
    def gain(self) -> float:
        return self.hisparse_concurrency / self.baseline_concurrency if self.baseline_concurrency else math.inf

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["inputs"]["geometry"] = asdict(self.inputs.geometry)
        d["bound_by"] = self.bound_by
        d["gain"] = self.gain
        d["baseline_bytes_per_request"] = self.baseline_blocks_per_request * self.block_bytes
        d["steady_bytes_per_request"] = self.steady_blocks_per_request * self.block_bytes
        return d


def gpu_concurrency(gpu_blocks: int, steady: int, admission: int) -> int:
    """Running requests that fit: the last one admitted needed `admission` free blocks, every
    earlier one holds `steady`."""
    if gpu_blocks < admission:
        return 0
    return 1 + (gpu_blocks - admission) // steady


def resident_context(p: PlanInputs) -> int:
    """The longest context whose requests stay resident (the hybrid rule): the hot buffer plus
    the active tail, in tokens."""
    return p.hot_rows + p.tail_pages * p.geometry.block_size


def _request_blocks(p: PlanInputs, pages: int) -> tuple[int, int, int, int, bool]:
    """GPU blocks of one request of `pages` pages: (indexer, all-resident, hisparse steady state,
    one admission, stays resident by the hybrid rule)."""
    g, bs = p.geometry, p.geometry.block_size
    indexer = -(-(pages * bs * g.index_layers * g.indexer_bytes) // g.block_bytes)
    baseline = pages + indexer
    hot_blocks = p.hot_rows // bs
    if pages <= hot_blocks + p.tail_pages:  # context <= resident_context, a whole number of pages
        return indexer, baseline, baseline, baseline, True
    return indexer, baseline, indexer + hot_blocks + p.tail_pages, baseline + hot_blocks, False


def _concurrencies(p: PlanInputs, pages: int) -> tuple[int, int, int, int]:
    """(all-resident, GPU-bound hisparse, host-bound hisparse, hisparse) concurrency at `pages` pages."""
    gpu_blocks = p.gpu_kv_bytes // p.geometry.block_bytes
    _, baseline, steady, admission, _ = _request_blocks(p, pages)
    gpu_conc = gpu_concurrency(gpu_blocks, steady, admission)
    # A host block holds the same tokens of every sparse layer as a GPU block; block 0 is null.
    host_conc = max(0, p.host_bytes // p.geometry.block_bytes - 1) // pages
    return gpu_blocks // baseline, gpu_conc, host_conc, min(gpu_conc, host_conc)


def crossover_context(p: PlanInputs, up_to: int = 1 << 24) -> int | None:
    """The shortest context, in tokens, at which hisparse runs more concurrent requests than
    all-resident under `p`'s budgets (every field of `p` but the context as given), or None if it
    does not up to `up_to` tokens.

    Up to the hot buffer and active tail the hybrid rule keeps requests resident, so hisparse
    equals all-resident (less where the host pool binds). Past them a request holds its hot
    buffer and active tail instead of its pages, fewer blocks; that pays once the admission kept
    free still fits as many requests. Concurrency depends on the context only through its pages, so the
    answer is the first token of a page.

    Exact without trying every page count: past the resident stretch both concurrencies fall as
    pages grow, so from a page count where hisparse runs `v` requests and does not lead, no
    crossover comes before all-resident drops below `v`; the search jumps there (a bisection).
    """
    bs = p.geometry.block_size
    gpu_blocks = p.gpu_kv_bytes // p.geometry.block_bytes
    last = min(-(-up_to // bs), gpu_blocks)   # beyond gpu_blocks pages neither fits one request
    pages = resident_context(p) // bs + 1
    while pages <= last:
        baseline, _, _, hisparse = _concurrencies(p, pages)
        if hisparse > baseline:
            return (pages - 1) * bs + 1
        if hisparse == 0:
            return None
        # The first page count whose all-resident concurrency is below `hisparse`: its request
        # takes more than gpu_blocks // hisparse blocks.
        need = gpu_blocks // hisparse + 1
        lo, hi = pages + 1, last + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if _request_blocks(p, mid)[1] >= need:
                hi = mid
            else:
                lo = mid + 1
        pages = lo
    return None


def no_crossover_reason(p: PlanInputs) -> str:
    """Why hisparse does not overtake all-resident under `p`'s budgets, in words: what bounds it
    just past the resident stretch (hot buffer and tail), where it would start to pay."""
    past = make_plan(replace(p, context=resident_context(p) + 1))
    if past.bound_by == "host pool":
        return "the host pool bounds it"
    if past.gpu_concurrency == 0:
        return (f"the GPU budget's {past.gpu_blocks} blocks hold no request past the hot buffer and tail (one "
                f"admission of {past.inputs.context} tokens needs {past.admission_blocks})")
    return "hot buffer, tail and the admission kept free cost the GPU as much as the pages"


def make_plan(p: PlanInputs) -> Plan:
    g, bs = p.geometry, p.geometry.block_size
    pages = -(-p.context // bs)
    block_bytes = g.block_bytes
    gpu_blocks = p.gpu_kv_bytes // block_bytes
    indexer, baseline, steady, admission, resident = _request_blocks(p, pages)
    hot_blocks = p.hot_rows // bs
    miss_rate = 0.0 if resident else p.miss_rate
    _, gpu_conc, host_conc, conc = _concurrencies(p, pages)
    host_block_bytes = block_bytes  # a host block holds the same tokens of every sparse layer
    host_blocks = p.host_bytes // host_block_bytes
    h2d_req = miss_rate * g.top_k * g.num_layers * g.row_bytes
    d2h_req = g.num_layers * g.row_bytes
    h2d = conc * h2d_req
    return Plan(
        inputs=p, pages_per_request=pages, gpu_blocks=gpu_blocks, block_bytes=block_bytes,
        indexer_blocks_per_request=indexer, baseline_blocks_per_request=baseline,
        baseline_concurrency=gpu_blocks // baseline, hot_blocks_per_request=hot_blocks,
        steady_blocks_per_request=steady, admission_blocks=admission, stays_resident=resident,
        miss_rate=miss_rate, gpu_concurrency=gpu_conc,
        host_block_bytes=host_block_bytes, host_blocks=host_blocks, host_concurrency=host_conc,
        hisparse_concurrency=conc, host_pool_bytes_needed=(gpu_conc * pages + 1) * host_block_bytes,
        h2d_bytes_per_request_step=h2d_req, d2h_bytes_per_request_step=d2h_req, h2d_bytes_per_step=h2d,
        d2h_bytes_per_step=conc * d2h_req, pcie_ms_per_step=1e3 * h2d / (p.pcie_gbps * 1e9),
    )


def parse_bytes(text: str) -> int:
    """'80GiB', '512 MiB', '1.5e9', '64G' (binary units for K/M/G/T with or without 'iB'; 'GB' is decimal)."""
    s = text.strip().replace(" ", "")
    units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
             "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    num, unit = s[:i], s[i:].lower()
    if unit not in units:
        raise InvalidInputError(f"cannot read {text!r} as a size; expected a number with an optional unit "
                                f"({', '.join(u for u in units if u)})")
    try:
        approx = float(num)
    except ValueError:
        raise InvalidInputError(f"cannot read {text!r} as a size: {num!r} is not a number") from None
    if approx < 0:
        raise InvalidInputError(f"size {text!r} is negative")
    if not math.isfinite(approx):
        raise InvalidInputError(f"size {text!r} is too large; expected at most {sys.float_info.max:.3g} of its unit")
    if approx == 0:  # also a tiny exponent such as 1e-999999999, which Fraction would expand in full
        return 0
    # Exact (a float product is off by more than a byte past 2**53, so a size that `floor_size` or
    # `ceil_size` printed would no longer read back as at most or at least the bytes it stood for).
    try:
        exact = Fraction(num)
    except ValueError:  # a spelling float() reads and Fraction() does not: the float's own value
        exact = Fraction(approx)
    return int(exact * units[unit])
