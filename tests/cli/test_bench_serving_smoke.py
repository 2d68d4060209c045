"""`bench/bench_serving.py --smoke`: the serving benchmark end to end on the CPU (tiny geometry),
every mode and the replay's workload, its table and plot, the engine modes' top-k from the code
locality model, and the results page's regime plot of its JSON; and its one-line refusal of a
budget that holds no request, before anything is built.

The first test runs both scripts from the command line, as a user does (so do the two cases of
`test_bad_flags_from_the_command_line`); the others call their `main(argv)` in process (a fresh
interpreter imports torch and transformers anew, 3-5 s a run), reading what the script printed
(`run_main`), and fail on an exception escaping `main()` as the script would end in a traceback.
Two tests read one run (`reference_layers_run`): the prefetch's rows are a part of that run's."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from bench_scripts import imported

from hisparse_core.registry import get_registry

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_serving.py"
PLOT = SCRIPT.with_name("plot_serving_regimes.py")


@pytest.fixture(scope="module")
def bench_main():
    """bench_serving.main, imported once."""
    with imported(SCRIPT) as module:
        yield module.main


@pytest.fixture(scope="module")
def plot_main():
    """plot_serving_regimes.main, imported once."""
    with imported(PLOT) as module:
        yield module.main


@dataclass
class Ran:
    """What a script's `main(argv)` returned and printed, as a run from the command line gives them."""

    returncode: int
    stdout: str
    stderr: str


def run_main(main: Callable[[list[str]], int], argv: list[str], capfd: pytest.CaptureFixture[str] | None) -> Ran:
    """`main(argv)` in process: its exit status (argparse's SystemExit included) and what it wrote to
    stdout and stderr meanwhile (at the file descriptors with `capfd`, else `sys.stdout`/`sys.stderr`,
    for a fixture wider than a test); every warning is shown, even one this process has shown before,
    as a fresh interpreter would."""
    out, err = io.StringIO(), io.StringIO()
    if capfd is not None:
        capfd.readouterr()
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.simplefilter("always")
        if capfd is None:
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
        try:
            code = main(argv)
        except SystemExit as exc:   # argparse's own refusals
            code = exc.code if isinstance(exc.code, int) else 1
    if capfd is None:
        return Ran(code, out.getvalue(), err.getvalue())
    return Ran(code, *capfd.readouterr())


def test_smoke_runs_every_mode(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--batches", "1", "--png", str(tmp_path / "p.png"),
                          "--json", str(tmp_path / "r.json"), "--topk-model", "code"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    assert {r["mode"] for r in rows} == {"hisparse", "all-resident", "transformers", "replay"}
    assert all(r.get("step_ms", 0) > 0 for r in rows), rows
    # The engine's host time per step comes in two parts: the next step's planning ahead is its own.
    engine_rows = [r for r in rows if r["mode"] in ("hisparse", "all-resident")]
    assert engine_rows and all(r["host_critical_ms"] > 0 and r["host_ahead_ms"] > 0 for r in engine_rows), engine_rows
    assert "host critical ms" in out.stdout and "host ahead ms" in out.stdout
    assert (tmp_path / "p.png").stat().st_size > 0 and "overhead" in out.stdout
    assert all(r["topk"] == "code" and "h2d_mb_per_step" in r for r in engine_rows), engine_rows
    assert "# hisparse backend: " in out.stdout
    assert all(r["backend"] in {e.name for e in get_registry().available()} for r in engine_rows), engine_rows
    assert "decode top-k from code" in out.stdout
    plot = subprocess.run([sys.executable, str(PLOT), str(tmp_path / "r.json"), "--png", str(tmp_path / "g.png")],
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert "| 160 | code | 1 |" in plot.stdout and (tmp_path / "g.png").stat().st_size > 10_000


def test_a_budget_without_room_for_one_request_is_one_line(bench_main, capfd: pytest.CaptureFixture[str]) -> None:
    out = run_main(bench_main, ["--smoke", "--gpu-kv-gib", "1e-6", "--png", ""], capfd)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and "cannot hold one hisparse request" in out.stderr, out.stderr


def test_smoke_runs_issue_42s_flags(bench_main, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Two contexts in one run, 'max' batches, untimed warm-up steps, all-resident at hisparse's
    batches under a larger budget, hisparse with and without the code regime's resident layer, and
    the rows without the indexer at each mode's largest batch."""
    out = run_main(bench_main, ["--smoke", "--contexts", "160,96", "--batches", "max",
                                "--modes", "hisparse,all-resident", "--topk-model", "code", "--resident-layers", "none/auto",
                                "--indexer-share", "max", "--all-resident-gib", "0.002", "--warmup", "2", "--steps", "1",
                                "--png", "", "--json", str(tmp_path / "r.json")], capfd)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    assert "layers [0] (standing for the reference layers 0-1" in out.stdout
    assert "2 untimed warm-up decode steps, then 1 timed" in out.stdout
    got = {(r["context"], r["mode"], r["topk"], r["batch"]) for r in rows}
    # hisparse's largest: 2 at 160 tokens, 3 at 96 (the resident layer's store still leaves room for them)
    want = set()
    for t, top in ((160, 2), (96, 3)):
        want |= {(t, "hisparse", "code", top), (t, "hisparse", "code+resident0", top),
                 (t, "all-resident", "code", top), (t, "hisparse", "code-no-indexer", top)}
    assert want <= got, sorted(got)
    # all-resident at hisparse's largest batch runs beyond the fixed budget, and says so; without the
    # indexer it also runs at its own largest within the budget
    res = [r for r in rows if r["mode"] == "all-resident"]
    assert any(not r["within_budget"] for r in res if r["topk"] == "code"), res
    assert any(r["within_budget"] for r in res if r["topk"] == "code-no-indexer"), res
    engine = [r for r in rows if "step_ms" in r]
    assert all(r["timed_steps"] == 1 and r["warmup_steps"] == 2 and "d2h_mb_per_step" in r for r in engine), engine
    assert all(r["resident_store_mb"] > 0 for r in engine if "+resident" in r["topk"])
    assert "at the fixed budget" in out.stdout


@pytest.fixture(scope="module")
def reference_layers_run(bench_main, plot_main, tmp_path_factory: pytest.TempPathFactory) -> tuple[Ran, list, Ran]:
    """One run under `--reference-layers spread/20,21,22,23 --prefetch-next-group off/on --resident-layers
    none/auto` (its rows, and the regime plot of its JSON), which two tests read: its spread rows without
    resident layers are those of the same command without the last two flags."""
    folder = tmp_path_factory.mktemp("reference_layers")
    run = run_main(bench_main, ["--smoke", "--batches", "2", "--modes", "hisparse,all-resident",
                                "--topk-model", "code", "--reference-layers", "spread/20,21,22,23",
                                "--prefetch-next-group", "off/on", "--resident-layers", "none/auto",
                                "--all-resident-gib", "0.002", "--png", "", "--json", str(folder / "r.json")], None)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((folder / "r.json").read_text())
    plot = run_main(plot_main, [str(folder / "r.json"), "--png", str(folder / "g.png")], None)
    return run, rows, plot


def test_smoke_runs_the_prefetch_both_ways(reference_layers_run: tuple[Ran, list, Ran]) -> None:
    """`--prefetch-next-group off/on`: every hisparse row without and with the prefetch (labelled
    +prefetch, compared with the same all-resident rows), the prefetches' misses given apart."""
    out, every, plot = reference_layers_run
    spread = [0, 20, 40, 60]
    rows = [r for r in every if r["reference_layers"] == spread and "resident0" not in r["topk"]]
    assert {(r["mode"], r["topk"]) for r in rows} == {("hisparse", "code"), ("hisparse", "code+prefetch"),
                                                      ("all-resident", "code")}
    pre = [r for r in rows if r["topk"] == "code+prefetch"]
    assert pre and all(r["critical_misses_per_step"] == r["misses_per_step"] - r["prefetch_misses_per_step"]
                       for r in pre)
    assert all("prefetch_misses_per_step" not in r for r in rows if r["topk"] == "code")
    assert "prefetch MB/step" in out.stdout and "T=160 (code+prefetch)" in out.stdout
    assert plot.returncode == 0 and "| 160 | code+prefetch | 2 |" in plot.stdout, plot.stdout + plot.stderr[-2000:]


def test_smoke_runs_reference_layers_side_by_side(reference_layers_run: tuple[Ran, list, Ran]) -> None:
    """`--reference-layers spread/20,21,22,23`: every hisparse row under both lists (the adjacent
    one labelled +ref20,21,22,23, with and without the prefetch), all-resident once under the first;
    the log names the lists once and every engine row records its list."""
    out, rows, plot = reference_layers_run
    got = {(r["mode"], r["topk"], tuple(r["reference_layers"])) for r in rows}
    spread, adjacent = (0, 20, 40, 60), (20, 21, 22, 23)
    # 'auto' keeps layer 0 (reference layer 0) resident under spread, nothing under 20-23 (no poor layer)
    assert got == {("hisparse", "code", spread), ("hisparse", "code+prefetch", spread),
                   ("hisparse", "code+resident0", spread), ("hisparse", "code+resident0+prefetch", spread),
                   ("hisparse", "code+ref20,21,22,23", adjacent), ("hisparse", "code+ref20,21,22,23+prefetch", adjacent),
                   ("all-resident", "code", spread)}, sorted(got)
    assert out.stdout.count("reference layers (of 61) the model's layers stand for: [0, 20, 40, 60] (spread) / "
                            "[20, 21, 22, 23]") == 1, out.stdout[:3000]
    assert "T=160 (code+ref20,21,22,23+prefetch)" in out.stdout
    assert plot.returncode == 0 and "| 160 | code+ref20,21,22,23+prefetch | 2 |" in plot.stdout, (
        plot.stdout + plot.stderr[-2000:])


def test_smoke_runs_the_prefetch_from_good_layers_and_stores_outside_the_budget(bench_main, tmp_path: Path,
                                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    """`--prefetch-next-group off/on/auto` under code and spread layers: auto prefetches from layers
    1-2 only (layer 0 stands for reference layer 0, whose top-k predicts nothing), labelled
    +prefetch-from1,2, with and without the resident layer; `--resident-stores inside/outside` runs
    the resident alternative with its store inside the budget (at its own largest batch, and
    all-resident there too) and on top of it (at hisparse's batches without resident layers)."""
    out = run_main(bench_main, ["--smoke", "--contexts", "320", "--batches", "max", "--modes",
                                "all-resident,hisparse", "--topk-model", "code", "--prefetch-next-group", "off/on/auto",
                                "--resident-layers", "none/auto", "--resident-stores", "inside/outside",
                                "--all-resident-gib", "0.002", "--png", "",
                                "--json", str(tmp_path / "r.json")], capfd)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    got = {(r["mode"], r["topk"], r["batch"]) for r in rows}
    top = {r["batch"] for r in rows if r["topk"] == "code" and r["mode"] == "hisparse"}
    inside = {r["batch"] for r in rows if r["topk"] == "code+resident0"}
    # 320 tokens, 320 KiB: hisparse holds 2, 1 with the resident layer's store inside the budget
    assert len(top) == len(inside) == 1 and inside != top, sorted(got)
    (b,), (b_in,) = top, inside
    labels = ["code", "code+prefetch", "code+prefetch-from1,2"]
    want = {("hisparse", x, b) for x in labels}
    want |= {("hisparse", x.replace("code", "code+resident0", 1), b_in) for x in labels}
    want |= {("hisparse", x.replace("code", "code+resident0-outside", 1), b) for x in labels}
    assert got == want | {("all-resident", "code", b), ("all-resident", "code", b_in)}, sorted(got)
    res = [r for r in rows if "+resident0-outside" in r["topk"]]
    assert all(r["resident_stores_outside_budget_gib"] > 0 for r in res), res
    assert all("resident_stores_outside_budget_gib" not in r for r in rows if "-outside" not in r["topk"])
    auto = [r for r in rows if "prefetch-from1,2" in r["topk"]]
    assert all(r["prefetch_misses_per_step"] >= 0 and "critical_misses_per_step" in r for r in auto), auto
    assert "their stores inside it / on top of the budget" in out.stdout
    # benign has no poor layer: auto is every layer, the same rows as on (run once)
    out = run_main(bench_main, ["--smoke", "--batches", "2", "--modes", "hisparse",
                                "--topk-model", "benign", "--prefetch-next-group", "off/on/auto", "--png", "",
                                "--json", str(tmp_path / "b.json")], capfd)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(r["topk"] for r in json.loads((tmp_path / "b.json").read_text())) == ["benign", "benign+prefetch"]


def test_smoke_runs_fp8_indexer_keys_beside_the_models(bench_main, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """--indexer-keys fp8/model: every engine row under each format, each with its own largest
    batches at the budget (fp8 keys hold more requests), the capacity arithmetic printed once per
    context and format, and rows labelled by format; the ratio column pairs rows of one format."""
    out = run_main(bench_main, ["--smoke", "--batches", "max,budget", "--modes",
                                "hisparse,all-resident", "--topk-model", "code", "--indexer-keys", "fp8/model",
                                "--all-resident-gib", "0.002", "--warmup", "1", "--steps", "1", "--png", "",
                                "--json", str(tmp_path / "k.json")], capfd)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "k.json").read_text())
    by = {(r["mode"], r["indexer_keys"]): sorted(x["batch"] for x in rows if x["mode"] == r["mode"]
                                                 and x["indexer_keys"] == r["indexer_keys"]) for r in rows}
    assert set(by) == {(m, k) for m in ("hisparse", "all-resident") for k in ("fp8", "model")}, by
    assert max(by[("hisparse", "fp8")]) > max(by[("hisparse", "model")]), by
    assert all(r["topk"] == ("code:fp8" if r["indexer_keys"] == "fp8" else "code") for r in rows), rows
    lines = [x for x in out.stdout.splitlines() if x.startswith("# capacity at T=160")]
    assert len(lines) == 2 and "indexer keys fp8 (20 B a token a layer; model 64 B)" in lines[0], lines
    assert f"-> {max(by[('hisparse', 'fp8')])};" in lines[0] and "--fill-chunk 32" in lines[0], lines
    assert "T=160 (code:fp8): best tokens/s" in out.stdout


def test_a_fill_chunk_of_no_tokens_is_one_line(bench_main, capfd: pytest.CaptureFixture[str]) -> None:
    """Checked before anything is built: a chunk of 0 would fill no context."""
    out = run_main(bench_main, ["--fill-chunk", "0", "--png", ""], capfd)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "bench_serving: --fill-chunk=0: expected a positive number of prompt tokens a forward"], out.stderr


def test_smoke_keeps_the_page_and_chunk_the_user_gave(bench_main, capfd: pytest.CaptureFixture[str]) -> None:
    """--smoke's tiny geometry fills only what is unset: a page of 8 tokens and 16-token prefill
    forwards show in the capacity line and the header."""
    out = run_main(bench_main, ["--smoke", "--batches", "1", "--modes", "hisparse",
                                "--block-size", "8", "--fill-chunk", "16", "--png", ""], capfd)
    assert out.returncode == 0, out.stderr
    assert "block 8;" in out.stdout and "--fill-chunk 16" in out.stdout, out.stdout
    # batch 1 keeps every page resident: no entry went through the hot buffer, so no hit rate (it said 100%)
    row = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith('{"mode": "hisparse"')))
    assert row["hot_lookups"] == 0 and row["released"] == 0, row
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("hisparse T=160"))
    assert " n/a " in line and "100%" not in line, line


def test_a_fill_chunk_past_the_context_is_sized_as_the_engine_sizes_it(bench_main, capfd: pytest.CaptureFixture[str]) -> None:
    """No forward holds more than max_context tokens (the engine sizes its pool so): a --fill-chunk
    past it was counted whole, so --fill-chunk 100000 was refused as needing 0.14 GiB of GPU KV; the
    engine takes a request at 0.0004 GiB."""
    out = run_main(bench_main, ["--smoke", "--batches", "1", "--modes", "hisparse",
                                "--fill-chunk", "100000", "--gpu-kv-gib", "0.0004", "--steps", "1", "--warmup", "0",
                                "--png", ""], capfd)
    assert out.returncode == 0, out.stderr[-2000:]
    # max_context 168 tokens (160 + 1 step + 3 + a page of 4): 42 pages, + 1
    assert "(--fill-chunk 100000: 43 pages a request writes in a step)" in out.stdout, out.stdout


def test_without_a_gpu_and_without_smoke_it_is_one_line(bench_main, capfd: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the bench would run")
    out = run_main(bench_main, ["--png", ""], capfd)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "bench_serving: needs a CUDA GPU (this torch sees none); expected --smoke for the tiny geometry on the CPU"], (
        out.stderr)


def test_without_matplotlib_the_plot_is_left_out_in_one_line(bench_main, tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # what `import matplotlib` finds where it is not installed: an ImportError (matplotlib.pyplot too)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    out = run_main(bench_main, ["--smoke", "--batches", "1", "--modes", "hisparse", "--steps", "1", "--warmup", "0",
                                "--png", str(tmp_path / "p.png")], capfd)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "matplotlib is not installed (pip install -e '.[plot]'), so no plot is drawn" in out.stdout
    assert not (tmp_path / "p.png").exists() and "# plot:" not in out.stdout


def test_smoke_runs_fp8_rows_beside_the_models(bench_main, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """--kv-rows fp8/model: every engine row under each row format, the fp8 rows (64 B here, the
    tiny geometry's fp32 rows 96 B) holding more requests at the budget, rows labelled by format."""
    out = run_main(bench_main, ["--smoke", "--batches", "max", "--modes",
                                "hisparse,all-resident", "--topk-model", "code", "--kv-rows", "fp8/model",
                                "--all-resident-gib", "0.002", "--warmup", "1", "--steps", "1", "--png", "",
                                "--json", str(tmp_path / "r.json")], capfd)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    by = {(r["mode"], r["kv_rows"]): sorted(x["batch"] for x in rows if x["mode"] == r["mode"]
                                            and x["kv_rows"] == r["kv_rows"]) for r in rows}
    assert set(by) == {(m, k) for m in ("hisparse", "all-resident") for k in ("fp8", "model")}, by
    assert max(by[("hisparse", "fp8")]) > max(by[("hisparse", "model")]), by
    assert all(r["row_bytes"] == (64 if r["kv_rows"] == "fp8" else 96) for r in rows), rows
    assert all(r["topk"] == ("code:fp8-rows" if r["kv_rows"] == "fp8" else "code") for r in rows), rows
    lines = [x for x in out.stdout.splitlines() if x.startswith("# capacity at T=160")]
    assert len(lines) == 2 and "latent rows fp8 (64 B a token a layer)" in lines[0], lines


@pytest.mark.parametrize("args, flag", [
    (["--resident-layers", "none/9"], "--resident-layers"),
    (["--resident-layers", "0,1,2,3"], "--resident-layers"),
    (["--indexer-share", "max"], "--indexer-share"),                      # --topk-model indexer
    (["--topk-model", "code", "--indexer-share", "x"], "--indexer-share"),
    (["--topk-model", "code", "--indexer-share", "max@999"], "--indexer-share"),   # not a context of the run
    (["--batches", "0"], "--batches"),
    (["--contexts", "160,abc"], "--contexts"),
    (["--modes", "hisparse,fast"], "--modes"),
    (["--all-resident-gib", "-1"], "--all-resident-gib"),
    (["--batches", "99"], "fits no mode at any context"),
    (["--prefetch-next-group", "maybe"], "--prefetch-next-group"),
    (["--prefetch-next-group", "off/auto/sometimes"], "--prefetch-next-group"),
    (["--resident-stores", "inside/beside"], "--resident-stores"),
    (["--topk-model", "code", "--reference-layers", "20,21,22"], "--reference-layers='20,21,22': 3 layers for 4"),
    (["--topk-model", "code", "--reference-layers", "spread/23,22,21,20"], "not strictly ascending"),
    (["--topk-model", "code", "--reference-layers", "20,21,22,61"], "--reference-layers"),
    (["--topk-model", "code", "--reference-layers", "adjacent"], "'adjacent' is not a layer"),
    (["--reference-layers", "20,21,22,23"], "needs --topk-model benign or code"),
    (["--indexer-keys", "fp4"], "--indexer-keys='fp4'"),
    (["--indexer-keys", "fp8/bf16"], "--indexer-keys='bf16'"),
    (["--indexer-keys", "fp8", "--modes", "hisparse,transformers"], "--indexer-keys='fp8' with --modes transformers"),
    (["--kv-rows", "int8"], "--kv-rows='int8'"),
    (["--kv-rows", "fp8/bf16"], "--kv-rows='bf16'"),
    (["--kv-rows", "fp8", "--modes", "hisparse,replay"], "--kv-rows='fp8' with --modes replay"),
    (["--fill-chunk", "0"], "--fill-chunk=0"),              # --smoke no longer overrides a chunk the user gave
    (["--block-size", "0"], "--block-size=0"),
    (["--dense-ffn-gb", "-1"], "--dense-ffn-gb=-1"),
    (["--batches", ""], "--batches=''"),                   # ran the default batches: '' was the default
    (["--dense-ffn-gb", "nan"], "--dense-ffn-gb=nan"),
    (["--host-gib", "0"], "--host-gib=0"),
    # each of these raised a traceback (after the model was built, for --seed and --hot-rows 8)
    (["--gpu-kv-gib", "nan"], "--gpu-kv-gib=nan"),
    (["--gpu-kv-gib", "inf"], "--gpu-kv-gib=inf"),
    (["--all-resident-gib", "inf"], "--all-resident-gib=inf"),
    (["--host-gib", "inf"], "--host-gib=inf"),
    (["--seed", "-1"], "--seed=-1"),
    (["--seed", str(10**14)], f"--seed={10**14}: expected a seed in [0, 4294967295]"),  # manual_seed overflowed
    (["--resident-layers", "1,,2"], "--resident-layers='1,,2': resident layers '1,,2' have an empty item"),  # ran [1, 2]
    (["--resident-layers", "none/,1"], "--resident-layers='none/,1'"),                       # ran [1]
    (["--hot-rows", "-1"], "--hot-rows=-1"),
    (["--hot-rows", "3"], "--hot-rows=3"),                # not a whole page: it was rounded down to none
    (["--hot-rows", "18"], "--hot-rows=18"),              # rounded down to 16 silently
    (["--hot-rows", "8"], "--hot-rows=8"),                # below the tiny model's top-k of 16
    (["--hot-rows", "40000"], "--hot-rows=40000"),        # above a runtime's 32768 rows
    (["--block-size", "4096"], "--block-size 4096) exceeds --max-context=4096: expected --max-context >= 4262"),
    (["--modes", ""], "--modes=''"),                      # ran every mode
    (["--backend", "bogus"], "--backend 'bogus': no hisparse backend named 'bogus'"),   # a traceback, after the model
    # written after the whole run: a traceback there, every figure lost
    (["--json", "/nonexistent/r.json"], "--json '/nonexistent/r.json': the folder '/nonexistent' does not exist"),
    (["--png", "/nonexistent/p.png"], "--png '/nonexistent/p.png': the folder '/nonexistent' does not exist"),
    (["--png", "p.txt"], "--png 'p.txt': matplotlib cannot write .txt files"),
    # batches no selected mode holds: an empty table and exit status 0
    (["--kv-rows", "fp8", "--modes", "all-resident", "--batches", "3"], "--batches='3' runs nothing"),  # hisparse's
    (["--contexts", "1500", "--gpu-kv-gib", "0.0006", "--modes", "hisparse,all-resident", "--batches", "budget"],
     "--batches='budget' runs nothing"),
])
def test_bad_flags_are_one_line_naming_the_flag(bench_main, args: list[str], flag: str) -> None:
    # In process (a fresh interpreter a case cost about 3 s each); an exception escaping main() fails
    # the test as a traceback would, and the two cases below run the script as a user does.
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = bench_main(["--smoke", "--png", "", *args])
        except SystemExit as exc:   # argparse's own refusals
            code = exc.code
    assert code == 2, err.getvalue()
    assert err.getvalue().count("\n") == 1 and flag in err.getvalue(), err.getvalue()


@pytest.mark.parametrize("args, flag", [
    (["--batches", "0"], "--batches"),
    (["--json", "/nonexistent/r.json"], "--json '/nonexistent/r.json': the folder '/nonexistent' does not exist"),
])
def test_bad_flags_from_the_command_line(args: list[str], flag: str) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--png", "", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and flag in out.stderr, out.stderr


def test_sizing_prints_the_production_capacity_without_a_gpu(bench_main, tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """--sizing: DeepSeek-V3.2's geometry at 32K, fp8 keys and rows, a 2048-row hot buffer, sized as a
    run would and checked against the arithmetic written out here; nothing is built or written."""
    monkeypatch.chdir(tmp_path)
    out = run_main(bench_main, ["--sizing", "--contexts", "32768", "--gpu-kv-gib", "3", "--indexer-keys", "fp8",
                                "--kv-rows", "fp8", "--hot-rows", "2048", "--fill-chunk", "64"], capfd)
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]
    # A block: 64 tokens x 4 layers x 656 B; keys 32768 x 4 x 132 B. The pages of a request: 32768 + 1024
    # of max context over 64, + 1 (514). hisparse: 32 hot + 2 tail + 3 x 2 recent + 2 watermark blocks and
    # its keys each, and one more hot buffer of watermark; all-resident: 514 pages + the same 42 blocks.
    block, keys, budget = 64 * 4 * 656, 32768 * 4 * 132, 3 * 2**30
    hisparse = (budget - 32 * block) // (42 * block + keys)
    all_resident = budget // ((514 + 42) * block + keys)
    assert (hisparse, all_resident) == (132, 29)
    assert f"capacity {hisparse / all_resident:.2f}x" in out.stdout, out.stdout
    assert "-> 132; all-resident a request: 514 pages + the engine's same 42-block minimum" in out.stdout
    assert list(tmp_path.iterdir()) == []
