"""`print(hs.stats())` is a few readable lines that carry the snapshot's own figures."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

from hisparse_transformers.stats import HiSparseStats  # noqa: E402


def _stats(**over: object) -> HiSparseStats:
    values: dict[str, object] = {}
    for i, f in enumerate(dataclasses.fields(HiSparseStats)):
        if f.default is not dataclasses.MISSING:
            continue
        values[f.name] = {"str": f"v{i}", "float": 1000.0 + i}.get(str(f.type), 7000 + i)
    values.update(backend="nvidia", device="cuda:0", decode_mode="cuda graph", hits=300, misses=100)
    values.update(over)
    return HiSparseStats(**values)  # type: ignore[arg-type]


def test_the_text_is_short_and_names_the_figures() -> None:
    s = _stats()
    text = str(s)
    lines = text.splitlines()
    assert 3 <= len(lines) <= 8 and all(len(line) <= 160 for line in lines), text
    assert lines[0].startswith("hisparse on nvidia (cuda:0)") and "cuda graph" in lines[0]
    assert "300 hot-buffer hits, 100 misses (75.0% hits)" in text
    for name in ("requests", "prefill_tokens", "decode_tokens", "resident", "prefix_hit_tokens"):
        assert str(getattr(s, name)) in text, name
    assert "resident layers" not in text and "prefetched" not in text and "assisted" not in text
    assert repr(s).startswith("HiSparseStats(backend='nvidia'")   # the repr keeps every field
    assert ": 1 request, decode" in str(_stats(requests=1))         # before: "1 requests"


def test_no_decode_rate_where_nothing_was_decoded() -> None:
    """A generate of one new token a prompt (its prefill makes it) decodes nothing: the line said
    '0 decoded (0.0/s)', a rate that was never measured."""
    text = str(_stats(decode_tokens=0, decode_tokens_per_s=0.0))
    assert "0 decoded\n" in text + "\n" and "(0.0/s)" not in text, text


def test_optional_lines_appear_when_their_feature_ran() -> None:
    text = str(_stats(resident_layers=(0, 1), resident_store_bytes=3 << 20, prefetch_misses=12,
                      prefetch_h2d_bytes=2048, verify_steps=4, verify_rows=16, rollbacks=2, rolled_back_tokens=5))
    assert "resident layers [0, 1]: 3.00 MiB" in text
    assert "prefetched: 12 rows, 2.00 KiB" in text
    assert "4 verify steps over 16 rows, 2 rollbacks (5 tokens)" in text


def test_fp8_rows_are_named_and_their_check_says_within_rounding() -> None:
    text = str(_stats(kv_rows="fp8", row_format="fp8_ds_mla", row_bytes=656, checked_entries=10,
                      checked_max_abs_diff=0.125))
    assert "rows: fp8_ds_mla, 656 B a token a layer (kv_rows='fp8')" in text
    assert "checked: 10 rows, max abs diff 0.125 (fp8 rows: within their rounding of the model's latent)" in text
    plain = str(_stats(row_format="hf_mla_bfloat16_576", row_bytes=1152, checked_entries=10))
    assert "rows: hf_mla_bfloat16_576, 1152 B" in plain and "within their rounding" not in plain


def test_no_hot_buffer_lookup_is_no_hit_rate() -> None:
    """Where no lookup went through the hot buffer (every entry resident, or no decode step), the
    text said '(100.0% hits)' of nothing; it says n/a, as `hisparse run` does (to_json keeps 1.0)."""
    s = _stats(hits=0, misses=0)
    assert "0 hot-buffer hits, 0 misses (n/a: no lookup went through the hot buffer)" in str(s), str(s)
    assert "100.0%" not in str(s) and s.to_json()["hit_rate"] == 1.0
