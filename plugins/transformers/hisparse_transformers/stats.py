"""What one enabled model measured: throughput, the hot buffer, bytes moved and GPU KV footprint."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hisparse_core.replay.report import NO_LOOKUPS, counted
from hisparse_core.units import human_bytes


@dataclass(frozen=True, slots=True)
class HiSparseStats:
    """Totals since `enable` (a snapshot; `HiSparseHandle.stats()` makes one).

    - Throughput: tokens each forward wrote (prefill: prompt tokens not served by a prefix hit;
      decode: one per running row and step) over the time of those forwards.
    - Hot buffer: `resident` entries served from resident pages, `hits` and `misses` hot-buffer
      lookups of the decode resolves (a miss is one host row copied into the hot buffer).
    - Bytes: `h2d_bytes` host to device by the resolver's gathers and replays (and restores),
      `prefill_host_bytes` rows the prefill read straight from the host pool, `d2h_bytes` row
      mirrors and spills to host.
    - GPU KV per request, at the peak of the batch: `gpu_kv_bytes_per_request` is what hisparse
      leased (resident pages plus the hot buffer) per running request;
      `gpu_kv_bytes_per_request_all_resident` what the same requests' KV takes with every page
      resident (transformers alone keeps all of it on the device). `indexer_bytes_per_request`
      (the indexer keys, on the device in both cases) is not included in either.
    - Decode: `decode_mode` says whether decode steps replay a CUDA graph (and why not), and
      `graph_captures` how many captures that took (one per batch, plus one each time a batch's
      indexer key buffers grew).
    - Assisted generation: `verify_steps` forwards whose rows (the token before the candidates
      and the candidates) resolved as one union per request, `verify_rows` their rows,
      `union_entries` the top-k entries of those rows and `union_shared_entries` how many of them
      picked a position another row of the same request's union also picked (resolved once);
      `rollbacks` crops that dropped rejected candidates, `rolled_back_tokens` the rows dropped.
      Throughput counts accepted tokens only.
    - `resident_layers` (enable's): those layers keep every position on the GPU in
      `resident_store_bytes` of the budget; hits, misses, H2D bytes and the per-request and pool
      bytes above count only the layers through hisparse.
    - `prefetch_next_group` (enable's): `prefetch_misses` host rows the prefetches copied (the next
      group's resolve on this group's top-k, off the critical path) and `prefetch_h2d_bytes` their
      bytes; both are included in `misses` and `h2d_bytes` (the critical path's: the difference).
    """

    backend: str
    device: str
    requests: int
    prefix_hit_tokens: int
    prefill_tokens: int
    decode_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    resident: int
    hits: int
    misses: int
    h2d_bytes: int
    prefill_host_bytes: int
    d2h_bytes: int
    spills: int
    released_pages: int
    lost_pages: int
    gpu_kv_bytes_per_request: float
    gpu_kv_bytes_per_request_all_resident: float
    indexer_bytes_per_request: float
    gpu_pool_bytes: int
    host_pool_bytes: int
    checked_entries: int
    checked_max_abs_diff: float
    decode_mode: str                 # "cuda graph", or "eager (why)"
    graph_captures: int
    checked_topk_queries: int = 0    # check=True: leader queries whose top-k was compared with the model's own
    checked_topk_ties: int = 0       # of them, those that differ only in the order of exactly tied scores
    checked_topk_boundary_ties: int = 0   # of them, those whose k-th score ties exactly with a key left out
    checked_topk_near_ties: int = 0       # of the rest, a key left out within check.near_tie_bound of the k-th
    verify_steps: int = 0
    verify_rows: int = 0
    union_entries: int = 0
    union_shared_entries: int = 0
    rollbacks: int = 0
    rolled_back_tokens: int = 0
    resident_layers: tuple[int, ...] = ()   # layers whose whole KV stays on the GPU (not in the counts above)
    resident_store_bytes: int = 0           # their stores, taken from gpu_kv_gib before the block pool
    prefetch_misses: int = 0                # host rows copied by cross-layer prefetches (in `misses` too)
    prefetch_h2d_bytes: int = 0             # their bytes, every layer of the group (in `h2d_bytes` too)
    kv_rows: str = "model"                  # how the latent rows are stored (enable's kv_rows)
    row_format: str = ""                    # their registered format (fp8_ds_mla for DeepSeek-V3.2 in fp8)
    row_bytes: int = 0                      # bytes of one token's row in one layer

    @property
    def hit_rate(self) -> float:
        looked = self.hits + self.misses
        return self.hits / looked if looked else 1.0

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "hit_rate": self.hit_rate}

    def __str__(self) -> str:
        """A few lines for `print(hs.stats())`; the fields themselves (and `to_json`) hold every figure."""
        lines = [
            f"hisparse on {self.backend} ({self.device}): {counted(self.requests, 'request')}, "
            f"decode {self.decode_mode}",
            f"  tokens: {self.prefill_tokens} prefilled ({self.prefill_tokens_per_s:.1f}/s, "
            f"{self.prefix_hit_tokens} more served by prefix hits), {self.decode_tokens} decoded"
            + (f" ({self.decode_tokens_per_s:.1f}/s)" if self.decode_tokens else ""),
            f"  top-k entries: {self.resident} from resident pages, {self.hits} hot-buffer hits, "
            f"{self.misses} misses ("
            + (f"{100 * self.hit_rate:.1f}% hits)" if self.hits + self.misses else
               f"{NO_LOOKUPS})"),
            f"  bytes: {human_bytes(self.h2d_bytes)} host to device, {human_bytes(self.d2h_bytes)} device to host, "
            f"{human_bytes(self.prefill_host_bytes)} read from the host pool by prefill",
            f"  GPU KV per request: {human_bytes(self.gpu_kv_bytes_per_request)} "
            f"(all resident: {human_bytes(self.gpu_kv_bytes_per_request_all_resident)}; indexer keys "
            f"{human_bytes(self.indexer_bytes_per_request)} in both)",
        ]
        if self.row_format:
            lines.insert(4, f"  rows: {self.row_format}, {self.row_bytes} B a token a layer (kv_rows={self.kv_rows!r})")
        if self.resident_layers:
            lines.append(f"  resident layers {list(self.resident_layers)}: {human_bytes(self.resident_store_bytes)}")
        if self.prefetch_misses:
            lines.append(f"  prefetched: {self.prefetch_misses} rows, {human_bytes(self.prefetch_h2d_bytes)} "
                         "(in the misses and bytes above)")
        if self.verify_steps:
            lines.append(f"  assisted: {self.verify_steps} verify steps over {self.verify_rows} rows, "
                         f"{self.rollbacks} rollbacks ({self.rolled_back_tokens} tokens)")
        if self.checked_entries:
            within = " (fp8 rows: within their rounding of the model's latent)" if self.kv_rows == "fp8" else ""
            lines.append(f"  checked: {self.checked_entries} rows, max abs diff {self.checked_max_abs_diff:.3g}{within}")
        return "\n".join(lines)
