"""Where hisparse overtakes all-resident as context grows (`planner.crossover_context`), and the
plot that shows it and why (`hisparse plan --plot`): the crossover against a brute-force scan,
by hand, and as drawn."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_core.cli import main
from hisparse_core.planner import MODELS, ModelGeometry, PlanInputs, crossover_context, make_plan, resident_context

TINY = ModelGeometry("tiny", num_layers=2, row_bytes=656, indexer_bytes=132, top_k=64, block_size=16, index_share=2)
DEFAULT = PlanInputs(MODELS["deepseek-v3.2"], 40 << 30, 256 << 30, 131072, 4096, 0.134)


def brute_force_crossover(p: PlanInputs, up_to: int) -> int | None:
    """Every page count in turn: the first token of the first page count where hisparse leads."""
    bs = p.geometry.block_size
    for pages in range(1, -(-up_to // bs) + 1):
        plan = make_plan(replace(p, context=pages * bs))
        if plan.hisparse_concurrency > plan.baseline_concurrency:
            return (pages - 1) * bs + 1
    return None


def test_crossover_by_hand() -> None:
    # TINY: block 16 x 2 x 656 = 20992 B; 3 MiB = 149 GPU blocks, 8 MiB = 399 host blocks; hot 128
    # rows = 8 blocks, tail 2. At 11 pages: indexer 2, all resident 149 // 13 = 11, hisparse
    # 1 + (149 - 21) // 12 = 11 (a tie); at 12 pages: 149 // 14 = 10 against 1 + (149 - 22) // 12 = 11.
    p = PlanInputs(TINY, 3 << 20, 8 << 20, 714, hot_rows=128, miss_rate=0.25)
    assert crossover_context(p) == 11 * 16 + 1 == 177
    at, before = make_plan(replace(p, context=177)), make_plan(replace(p, context=176))
    assert (at.baseline_concurrency, at.hisparse_concurrency) == (10, 11)
    assert (before.baseline_concurrency, before.hisparse_concurrency) == (11, 11)
    # The built-in model at the CLI's defaults: past 64 + 2 pages a request holds 64 hot + 2 tail blocks,
    # which pays from 67 pages on (207 against 208 requests).
    assert crossover_context(DEFAULT) == 66 * 64 + 1 == 4225


def test_no_stretch_past_the_hot_buffer_where_hisparse_runs_fewer() -> None:
    """At 65 and 66 pages (4097-4224 tokens at the defaults) a request's hot buffer and tail cost
    more than its pages: it stays resident, so hisparse runs what all-resident runs (it ran 208
    against 212 when only the hot buffer's 64 pages stayed resident)."""
    assert resident_context(DEFAULT) == 4096 + 2 * 64
    for context, requests in ((4097, 212), (4160, 212), (4161, 209), (4224, 209)):
        plan = make_plan(replace(DEFAULT, context=context))
        assert plan.stays_resident and plan.miss_rate == 0.0
        assert plan.hisparse_concurrency == plan.baseline_concurrency == requests, context
    past = make_plan(replace(DEFAULT, context=4225))
    assert not past.stays_resident and (past.hisparse_concurrency, past.baseline_concurrency) == (208, 207)
    for pages in range(1, 2049):  # up to 128K tokens: never behind
        plan = make_plan(replace(DEFAULT, context=pages * 64))
        assert plan.hisparse_concurrency >= plan.baseline_concurrency, pages


@settings(max_examples=150, deadline=None)
@given(layers=st.integers(1, 8), share=st.integers(1, 4), row=st.integers(16, 1024), idx=st.integers(0, 512),
       top_k_pages=st.integers(1, 6), block=st.sampled_from([1, 4, 16]), hot_mult=st.integers(1, 3),
       gpu_blocks=st.integers(1, 600), host_blocks=st.integers(0, 4000), tail=st.integers(1, 6))
def test_crossover_is_the_first_context_where_hisparse_leads(layers: int, share: int, row: int, idx: int,
                                                             top_k_pages: int, block: int, hot_mult: int,
                                                             gpu_blocks: int, host_blocks: int, tail: int) -> None:
    g = ModelGeometry("g", layers, row, idx, top_k_pages * block, block, share)
    p = PlanInputs(g, gpu_blocks * g.block_bytes, host_blocks * g.block_bytes, 1, hot_mult * g.top_k, 0.1, tail)
    up_to = (gpu_blocks + 2) * block  # past that many pages nothing fits, with or without hisparse
    expected = brute_force_crossover(p, up_to)
    assert crossover_context(p, up_to=up_to) == expected
    assert crossover_context(p) == expected  # no crossover further out either
    if expected is not None:
        assert expected > resident_context(p)  # the hybrid rule: never ahead while requests stay resident
    bs = block
    for pages in range(1, gpu_blocks + 3):
        plan = make_plan(replace(p, context=pages * bs))
        if pages * bs <= resident_context(p):
            # Resident: exactly all-resident on the GPU, never fewer requests.
            assert plan.stays_resident and plan.gpu_concurrency == plan.baseline_concurrency
        elif plan.baseline_concurrency > plan.hot_blocks_per_request:
            # Past it each earlier request saves a block at least, and more of them than the
            # hot buffer the last admission keeps free: never behind either.
            assert plan.gpu_concurrency >= plan.baseline_concurrency, pages


def _figure_parts(fig):  # type: ignore[no-untyped-def]
    from hisparse_core.planner_plot import GID_CROSSOVER, GID_HOT_BUFFER, GID_NO_CROSSOVER

    ax = fig.axes[0]
    marks = [t for t in ax.texts if t.get_gid() == GID_CROSSOVER]
    never = [t for t in ax.texts if t.get_gid() == GID_NO_CROSSOVER]
    hot = [ln for ln in ax.get_lines() if ln.get_gid() == GID_HOT_BUFFER]
    curves = {ln.get_label(): ln for ln in ax.get_lines()}
    return marks, never, hot, curves


@pytest.mark.parametrize("inputs", [
    DEFAULT,
    replace(DEFAULT, geometry=MODELS["glm-5.2"], hot_rows=8192, gpu_kv_bytes=60 << 30),
    PlanInputs(TINY, 3 << 20, 8 << 20, 714, hot_rows=128, miss_rate=0.25),
], ids=["deepseek-default", "glm-5.2-hot-4x", "tiny"])
def test_plot_marks_the_planners_crossover_and_the_hot_buffer(inputs: PlanInputs) -> None:
    pytest.importorskip("matplotlib")
    from hisparse_core.planner_plot import ALL_RESIDENT, HISPARSE_RULE, context_range, plan_figure, pyplot

    plan = make_plan(inputs)
    fig = plan_figure(plan)
    try:
        _, hi = context_range(inputs)
        crossover = crossover_context(inputs, up_to=hi)
        assert crossover is not None
        marks, never, hot, curves = _figure_parts(fig)
        assert len(marks) == 1 and not never
        assert marks[0].xy[0] == crossover
        assert f"{crossover:,} tokens" in marks[0].get_text()
        assert len(hot) == 1 and list(hot[0].get_xdata()) == [inputs.hot_rows] * 2
        # The drawn curves agree with the mark: hisparse leads at the crossover, not a token before,
        # and equals all-resident wherever the context fits the hot buffer.
        base = dict(zip(curves[ALL_RESIDENT].get_xdata(), curves[ALL_RESIDENT].get_ydata(), strict=True))
        ours = dict(zip(curves[HISPARSE_RULE].get_xdata(), curves[HISPARSE_RULE].get_ydata(), strict=True))
        assert ours[crossover] > base[crossover] and ours[crossover - 1] <= base[crossover - 1]
        resident = [c for c in base if c <= inputs.hot_rows]
        assert resident and all(ours[c] == base[c] for c in resident)
        fig.savefig(io.BytesIO(), format="png")  # it renders
    finally:
        pyplot().close(fig)


def test_plot_says_when_hisparse_never_leads() -> None:
    pytest.importorskip("matplotlib")
    from hisparse_core.planner_plot import plan_figure, pyplot

    # A host pool of 30 blocks bounds hisparse below all-resident at every context.
    inputs = PlanInputs(TINY, 3 << 20, 30 * TINY.block_bytes, 714, hot_rows=128, miss_rate=0.25)
    assert crossover_context(inputs) is None
    fig = plan_figure(make_plan(inputs))
    try:
        marks, never, _, _ = _figure_parts(fig)
        assert not marks and len(never) == 1 and "the host pool bounds it" in never[0].get_text()
    finally:
        pyplot().close(fig)


def test_plan_cli_plot_json_and_table(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--context", "4096", "--sweep", "2048,8K", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "hisparse runs more          from 4225 tokens (67 pages); up to the 4096-row hot buffer" in out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--json"]) == 0
    assert json.loads(out.getvalue())["crossover_context"] == crossover_context(DEFAULT) == 4225


def test_plan_plot_into_a_missing_folder_fails_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "missing" / "plan.png"
    assert main(["plan", "--plot", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"hisparse plan: error: --plot {str(target)!r}: the folder "
                                         f"{str(target.parent)!r} does not exist"]
