"""`hisparse plan` and `hisparse_core.planner`: hand-checked arithmetic, built-in geometries, CLI."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

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
from hisparse_core.units import ceil_size, floor_size

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


@pytest.mark.parametrize("extra", [[], ["--json"], ["--sweep", "1,64"]])
def test_a_gpu_budget_that_holds_no_request_is_refused(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --gpu-kv 1B` printed a table of zeros whose lines blamed the hot buffer and tail
    ("hisparse runs more: never ...") and a host pool for "the GPU's 0 requests": the budget holds
    no block. A budget that holds no request at any context is one line naming --gpu-kv."""
    assert main(["plan", "--gpu-kv", "1B", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "hisparse plan: error: --gpu-kv 1 B holds no block of 2.44 MiB (61 layers x 64 tokens x 656 B), so no "
        "request fits at any context; expected --gpu-kv >= 4.89MiB (one 1-token request: 1 page + 1 indexer block), "
        ">= 6.03GiB for one request of --context 131072 with hisparse"]


@pytest.mark.parametrize(("host", "holds"), [("1B", "1 B holds no block"), ("3MiB", "3.00 MiB holds only the null block")])
def test_a_host_pool_that_holds_no_request_is_refused(host: str, holds: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --host 1B` printed a table saying 0 with hisparse (0.00x) at every context and "never"
    for the crossover, where `--gpu-kv 1B` is refused: no usable host block (block 0 is the null
    block) holds no request at any context either. The sizes named are the ones that hold one."""
    assert main(["plan", "--host", host]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"hisparse plan: error: --host {holds} of 2.44 MiB (61 layers x 64 tokens x 656 B), so no request fits at "
        "any context; expected --host >= 4.89MiB (one 1-token request: 1 page + the null block), >= 4.89GiB for one "
        "request of --context 131072"]
    assert main(["plan", "--host", "4.89MiB", "--context", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["host_concurrency"] == 1
    assert main(["plan", "--host", "4.89GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["host_concurrency"] == 1


def test_the_smallest_gpu_budget_plan_names_holds_one_request(capsys: pytest.CaptureFixture[str]) -> None:
    """One block (3 MiB) still holds no request; the size named holds one of a token, and the
    figure for --context admits one such request; budgets in between are plans (0 at --context)."""
    assert main(["plan", "--gpu-kv", "3MiB"]) == 2
    err = capsys.readouterr().err
    assert "holds 1 block of 2.44 MiB" in err
    smallest = err.split("expected --gpu-kv >= ")[1].split(" ")[0]
    at_context = err.split(", >= ")[1].split(" ")[0]
    assert main(["plan", "--gpu-kv", smallest, "--context", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["baseline_concurrency"] == doc["hisparse_concurrency"] == 1
    assert main(["plan", "--gpu-kv", smallest, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hisparse_concurrency"] == 0
    assert main(["plan", "--gpu-kv", at_context, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hisparse_concurrency"] == 1
    block = MODELS["deepseek-v3.2"].block_bytes
    assert parse_bytes(smallest) >= 2 * block and main(["plan", "--gpu-kv", str(2 * block - 1)]) == 2
    capsys.readouterr()
    # Blocks but no request of --context past the hot buffer: the table says so, not that the hot
    # buffer and tail cost as much as the pages.
    assert main(["plan", "--gpu-kv", smallest]) == 0
    assert ("never up to 16777216 tokens: the GPU budget's 2 blocks hold no request past the hot buffer and tail "
            "(one admission of 4225 tokens needs 145)") in " ".join(capsys.readouterr().out.split())


def test_the_published_miss_rate_is_the_hot_buffers_own(capsys: pytest.CaptureFixture[str]) -> None:
    """`--top-k 100 --hot 1.3` makes a hot buffer of 192 rows (whole 64-token blocks): 1.92x top-k,
    as the table's `request` line said, while the miss rate applied was the published figure at
    1.3x (22.11% where 1.92x gives 13.9%)."""
    assert main(["plan", "--top-k", "100", "--hot", "1.3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["hot_rows"] == 192
    assert doc["miss_rate"] == pytest.approx(published_miss_rate(1.92))
    assert doc["miss_rate_source"] == "published LRU figure at the hot buffer's 1.92x top-k"
    assert main(["plan", "--top-k", "100", "--hot", "1.3"]) == 0
    assert "hot buffer 192 rows (1.92x top-k; --hot 1.3 rounded up to whole 64-token blocks)" in capsys.readouterr().out
    assert main(["plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["miss_rate_source"] == "published LRU figure at 2x top-k"


def test_parse_bytes_refuses_an_infinite_size() -> None:
    """'1e400' overflowed a float and raised OverflowError (a traceback); it is one refusal now."""
    with pytest.raises(InvalidInputError, match=r"size '1e400' is too large"):
        parse_bytes("1e400")
    assert parse_bytes("1e-999999999") == 0   # underflows: no Fraction of a billion-digit denominator


@pytest.mark.parametrize("value", ["5e-324", "1e-300", "0.0009"])
def test_a_bandwidth_too_small_to_time_a_step_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--pcie-gbps 5e-324` (in the old range (0, 10000]) made the time per step overflow: the table said
    `inf ms at 4.94066e-324 GB/s` and --json `pcie_ms_per_step: null`, exit status 0."""
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--pcie-gbps", value])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [
        f"hisparse plan: error: argument --pcie-gbps: expected a number in [0.001, 10000], got {value} (see hisparse "
        "plan --help)"]


@given(st.integers(0, 1 << 100))
@example((1 << 93) + 1)
@example(10**30 + 7)
def test_printed_sizes_read_back_on_their_side(n: int) -> None:
    """`floor_size` promises a size that still fits when given back, `ceil_size` one that is enough:
    exact past 2**53, where float quotients and products are off by more than a byte."""
    down, up = parse_bytes(floor_size(n)), parse_bytes(ceil_size(n))
    assert down <= n <= up
    unit = max([1] + [s for s in (1 << 10, 1 << 20, 1 << 30, 1 << 40) if n >= s])
    assert n - down < unit / 100 + 1 and up - n < unit / 100 + 1
