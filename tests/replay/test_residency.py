"""Per-layer residency in the replay engine: layers kept fully resident are served from their own
pages (every entry checked against the all-resident copy), the coordinator and host pool carry
only the other layers, misses fall, and bad configurations are one line."""

from __future__ import annotations

import pytest

from hisparse_core.errors import CapacityError, InvalidInputError
from hisparse_core.registry import select_backend
from hisparse_core.replay.engine import ReplayEngine, RunConfig
from hisparse_core.replay.run import run_replay

BASE = dict(requests=3, context=1500, decode_tokens=12, steps=14, top_k=64, block_size=16, layers=4, index_share=1,
            gpu_kv_bytes=8 << 20, host_bytes=8 << 20, arrival_every=0, prefix_groups=0, topk_model="code",
            hot_multiple=2.0, validate=True, seed=1)


def _run(**over: object) -> dict[str, object]:
    return run_replay(RunConfig(**{**BASE, **over}), select_backend("reference_cpu")).summary()  # type: ignore[arg-type]


def test_resident_layers_are_served_from_their_own_pages_and_cut_misses() -> None:
    none = _run()
    # The same hisparse pool (blocks of the 3 other layers) plus the resident layer's own pages.
    resident = RunConfig(**{**BASE, "resident_layers": (0,)}).resident_kv_bytes  # type: ignore[arg-type]
    first = _run(resident_layers=(0,), gpu_kv_bytes=BASE["gpu_kv_bytes"] * 3 // 4 + resident)  # type: ignore[operator]
    # The same lookups are checked byte for byte in both runs (the resident layer's too).
    assert first["attention_entries_checked"] == none["attention_entries_checked"] > 0
    assert first["decode_rows"] == none["decode_rows"] > 0
    # Layer 0 stands for the code regime's layer 0 (1.5% overlap): it missed more than the
    # average layer, and its misses are gone.
    assert none["misses"] - first["misses"] > none["misses"] / 4  # type: ignore[operator]


def test_coordinator_and_worker_carry_only_the_other_layers() -> None:
    engine = ReplayEngine(RunConfig(**{**BASE, "resident_layers": (1, 0), "validate": False,  # type: ignore[arg-type]
                                     "gpu_kv_bytes": 12 << 20}),
                          select_backend("reference_cpu"))
    try:
        assert engine.config.resident_layers == (0, 1)
        assert engine.coordinator.config.num_layers == 2
        assert len(engine.worker.runtimes) == 2 and engine.offloaded_groups == [2, 3]
        for _ in range(4):
            engine.step()
        assert engine.totals.resident_layer_entries > 0
        held = engine.resident_pool.num_leased_blocks  # type: ignore[union-attr]
        assert held == len(engine.running) * engine.pages_per_request
    finally:
        engine.close()


@pytest.mark.parametrize("over,msg", [
    (dict(resident_layers=(4,)), "out of range"),
    (dict(resident_layers=(0, 1, 2, 3)), "at least one layer"),
    (dict(resident_layers=(0,), index_share=2), "splits index group"),
    (dict(topk_model="chat"), "topk_model"),
])
def test_bad_residency_config_is_one_line(over: dict[str, object], msg: str) -> None:
    with pytest.raises(InvalidInputError, match=msg):
        RunConfig(**{**BASE, **over})  # type: ignore[arg-type]


def test_resident_share_leaving_hisparse_too_little_is_refused_before_anything_is_built() -> None:
    with pytest.raises(CapacityError, match=r"^--gpu-kv 4\.00 MiB \(.* kept for resident layers \[0\].*expected "
                                            r"--gpu-kv >= 6\.55MiB"):
        ReplayEngine(RunConfig(**{**BASE, "resident_layers": (0,), "gpu_kv_bytes": 4 << 20}),  # type: ignore[arg-type]
                     select_backend("reference_cpu"))
