"""`hisparse plan` and `hisparse_core.planner`: hand-checked arithmetic, built-in geometries, CLI."""

from __future__ import annotations

import json
import math

import pytest

from hisparse_core.cli import main
from hisparse_core.errors import InvalidInputError
from hisparse_core.planner import (
    MODELS,
    ModelGeometry,
    PlanInputs,
    gpu_concurrency,
    make_plan,
    parse_bytes,
    published_miss_rate,
)

TINY = ModelGeometry("tiny", num_layers=2, row_bytes=656, indexer_bytes=132, top_k=64, block_size=16, index_share=2)


def test_plan_arithmetic_by_hand() -> None:
    # 714 tokens = 45 pages of 16; a block is 16 x 2 x 656 = 20992 B; 3 MiB = 149 blocks.
    p = make_plan(PlanInputs(TINY, 3 << 20, 8 << 20, 714, hot_rows=128, miss_rate=0.25))
    assert (p.pages_per_request, p.block_bytes, p.gpu_blocks) == (45, 20992, 149)
    # Indexer: 45 * 16 tokens x 1 indexer layer x 132 B = 95040 B -> 5 blocks.
    assert p.indexer_blocks_per_request == 5
    assert p.baseline_blocks_per_request == 50 and p.baseline_concurrency == 2
    assert p.steady_blocks_per_request == 5 + 8 + 2 and p.admission_blocks == 45 + 5 + 8
    assert p.gpu_concurrency == 1 + (149 - 58) // 15 == 7
    assert p.host_blocks == (8 << 20) // 20992 == 399 and p.host_concurrency == 398 // 45 == 8
    assert p.hisparse_concurrency == 7 and p.bound_by == "GPU"
    assert p.h2d_bytes_per_request_step == pytest.approx(0.25 * 64 * 2 * 656)
    assert p.d2h_bytes_per_request_step == 2 * 656
    assert p.h2d_bytes_per_step == pytest.approx(7 * 0.25 * 64 * 2 * 656)


def test_host_bound_and_no_admission() -> None:
    p = make_plan(PlanInputs(TINY, 3 << 20, 1 << 20, 714, hot_rows=128, miss_rate=0.1))
    assert p.host_concurrency == (49 - 1) // 45 == 1 and p.hisparse_concurrency == 1 and p.bound_by == "host pool"
    assert gpu_concurrency(gpu_blocks=10, steady=3, admission=11) == 0
    assert gpu_concurrency(gpu_blocks=11, steady=3, admission=11) == 1


def test_builtin_geometries_match_published_bytes_per_token() -> None:
    ds, glm, glm2 = MODELS["deepseek-v3.2"], MODELS["glm-5.1"], MODELS["glm-5.2"]
    assert ds.num_layers * ds.row_bytes == 40016          # ~40.0 KB per token (61 x 656 B)
    assert glm.num_layers * glm.row_bytes == 51168        # ~51.2 KB per token (78 x 656 B)
    assert (glm2.index_layers, glm.index_layers, ds.index_layers) == (20, 78, 61)
    assert all(m.top_k == 2048 and m.block_size == 64 for m in MODELS.values())


def test_published_miss_rate_interpolation() -> None:
    assert published_miss_rate(1) == 0.30 and published_miss_rate(2) == pytest.approx(0.134)
    assert published_miss_rate(4) == pytest.approx(0.067)
    assert 0.134 > published_miss_rate(3) > 0.067
    assert published_miss_rate(8) < 0.067


@pytest.mark.parametrize("text,value", [("80GiB", 80 << 30), ("512 MiB", 512 << 20), ("64G", 64 << 30),
                                        ("1.5e9", 1_500_000_000), ("2GB", 2_000_000_000), ("4096", 4096)])
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


def test_parse_bytes_rejects() -> None:
    with pytest.raises(InvalidInputError, match="size"):
        parse_bytes("12 parsecs")


def test_plan_cli_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "glm-5.2", "--gpu-kv", "60GiB", "--host", "384GiB", "--context", "131072",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["geometry"]["index_share"] == 4
    assert doc["hisparse_concurrency"] > doc["baseline_concurrency"] > 0
    assert doc["miss_rate_source"].startswith("published")
    assert main(["plan", "--sweep", "8192,131072"]) == 0
    out = capsys.readouterr().out
    for needle in ("without hisparse", "with hisparse", "host pool needed", "PCIe per decode step", "131072"):
        assert needle in out


def test_plan_cli_custom_needs_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "custom", "--layers", "2"]) == 2
    assert "--row-bytes" in capsys.readouterr().err


def test_plan_gain_is_finite_and_consistent() -> None:
    p = make_plan(PlanInputs(MODELS["deepseek-v3.2"], 40 << 30, 256 << 30, 131072, 4096, 0.134))
    assert math.isfinite(p.gain) and p.gain == p.hisparse_concurrency / p.baseline_concurrency
