"""Row formats and the fixed shapes a per-cache runtime is built for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse_core.errors import InvalidInputError


@dataclass(frozen=True, slots=True)
class RowFormat:
    """How one token's KV row of one layer is stored: `width` elements of `dtype`."""

    name: str
    dtype: torch.dtype
    width: int

    @property
    def row_bytes(self) -> int:
        return self.width * torch.empty((), dtype=self.dtype).element_size()

    def __post_init__(self) -> None:
        if self.width <= 0:
            raise InvalidInputError(f"RowFormat {self.name!r}: width must be > 0, got {self.width}")
        if self.row_bytes % 16:
            raise InvalidInputError(
                f"RowFormat {self.name!r}: rows must be a multiple of 16 bytes, got {self.row_bytes}")


#: DeepSeek FP8 MLA row: 512 B FP8 NoPE + 16 B fp32 scales + 128 B bf16 RoPE, stored as bytes.
FP8_DS_MLA = RowFormat("fp8_ds_mla", torch.uint8, 656)
#: BF16 MLA row: 512 + 64 bf16 elements.
BF16_MLA = RowFormat("bf16_mla", torch.bfloat16, 576)

ROW_FORMATS: dict[str, RowFormat] = {f.name: f for f in (FP8_DS_MLA, BF16_MLA)}


def row_format(name: str) -> RowFormat:
    try:
        return ROW_FORMATS[name]
    except KeyError:
        raise InvalidInputError(f"unknown row format {name!r}; expected one of {sorted(ROW_FORMATS)}") from None


def register_row_format(fmt: RowFormat) -> RowFormat:
    """Make `fmt` known by name, so `row_format(name)` and backends that check `ROW_FORMATS` accept it.

    For integrations whose rows are not an MLA format (e.g. a standard-attention paged cache served
    by the host tier). Registering an equal format again is a no-op; another format under a known
    name raises `InvalidInputError`.
    """
    if not isinstance(fmt, RowFormat):
        raise InvalidInputError(f"expected a RowFormat, got {type(fmt).__name__}")
    known = ROW_FORMATS.get(fmt.name)
    if known is not None and known != fmt:
        raise InvalidInputError(f"row format {fmt.name!r} is already registered as {known}; got {fmt}")
    ROW_FORMATS[fmt.name] = fmt
    return fmt


#: The most hot-buffer rows one request state of a runtime holds (`RuntimeConfig.hot_rows`).
MAX_HOT_ROWS = 32768


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """Fixed geometry of one per-cache runtime (one index group: a leader layer and its followers).

    Every resolve call uses these shapes, so a captured CUDA graph stays valid.

    - `max_batch_rows`: rows per resolve call (decode rows, speculative rows included).
    - `max_requests`: persistent request state rows (the engine's max_num_seqs).
    - `top_k`: entries per batch row.
    - `hot_rows`: hot-buffer rows per request state; a multiple of `block_size`, and at least
      `rows_per_request * top_k` so one step's union always fits.
    - `rows_per_request`: most batch rows one request may have in a call (1 + speculative tokens).
    - `block_size`: tokens per page (resident, hot and host pages alike).
    - `max_pages`: pages per request (cdiv(max_model_len, block_size)).
    - `num_layers`: layers sharing this runtime's miss plan (index 0 is the leader).
    """

    max_batch_rows: int
    max_requests: int
    top_k: int
    hot_rows: int
    block_size: int
    max_pages: int
    row_format: RowFormat = FP8_DS_MLA
    num_layers: int = 1
    rows_per_request: int = 1

    def __post_init__(self) -> None:
        for name in ("max_batch_rows", "max_requests", "top_k", "hot_rows", "block_size", "max_pages",
                     "num_layers", "rows_per_request"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidInputError(f"RuntimeConfig.{name} must be a positive int, got {v!r}")
        if self.hot_rows % self.block_size:
            raise InvalidInputError(
                f"RuntimeConfig.hot_rows={self.hot_rows} must be a multiple of block_size={self.block_size}")
        if self.hot_rows < self.rows_per_request * self.top_k:
            raise InvalidInputError(
                f"RuntimeConfig.hot_rows={self.hot_rows} must be >= rows_per_request*top_k="
                f"{self.rows_per_request * self.top_k} so one step's union fits the hot buffer")
        if self.hot_rows > MAX_HOT_ROWS:
            raise InvalidInputError(f"RuntimeConfig.hot_rows={self.hot_rows} exceeds the {MAX_HOT_ROWS}-row limit")

    @property
    def hot_blocks(self) -> int:
        return self.hot_rows // self.block_size

    @property
    def max_context(self) -> int:
        return self.max_pages * self.block_size
