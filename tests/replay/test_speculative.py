"""The replay's speculative mode (`acceptance` < 1): several decode rows per request resolved as one
union, the rejected ones read by the step's later rows, rolled back and written again with the
real contents. Every row every layer reads is compared with the all-resident reference, on
reference_cpu and on the strict device, under GPU and host pressure."""

from __future__ import annotations

from dataclasses import replace

import pytest
from strict_device import StrictDeviceBackend

from hisparse_core.errors import InvalidInputError
from hisparse_core.registry import select_backend
from hisparse_core.replay.engine import RunConfig
from hisparse_core.replay.run import run_replay

SPECULATIVE = RunConfig(requests=5, context=600, decode_tokens=16, steps=30, top_k=64, hot_multiple=5.0,
                        block_size=16, layers=2, index_share=2, rows_per_request=4, acceptance=0.5,
                        gpu_kv_bytes=5 << 20, host_bytes=7 << 20, arrival_every=0, seed=3)


@pytest.mark.parametrize("backend", ["reference_cpu", "strict_device"])
def test_rejected_rows_are_rolled_back_and_never_read_again(backend: str) -> None:
    be = select_backend("reference_cpu") if backend == "reference_cpu" else StrictDeviceBackend(completion_lag=2)
    result = run_replay(SPECULATIVE, be)
    s = result.summary()
    assert s["speculative_rows_rejected"] > 0 and s["speculative_rollbacks"] > 0, s
    # Every row of every layer was compared with the reference (a stale rejected row would differ).
    assert s["attention_mismatches"] == 0 and s["attention_entries_checked"] == s["decode_rows"] * 64 * 2 > 0
    assert s["misses"] > 0 and s["pages"]["released"] > 0, s
    # Rejections make requests take more steps: fewer tokens finish than rows were decoded.
    assert s["decode_rows"] > 5 * 16 or s["requests_finished"] < 5


def test_the_same_rejections_on_every_backend() -> None:
    a = run_replay(SPECULATIVE, select_backend("reference_cpu")).summary()
    b = run_replay(SPECULATIVE, StrictDeviceBackend(completion_lag=2)).summary()
    for key in ("speculative_rows_rejected", "decode_rows", "hits", "misses", "attention_entries_checked"):
        assert a[key] == b[key], key


def test_acceptance_out_of_range() -> None:
    with pytest.raises(InvalidInputError, match=r"acceptance must be a probability in \[0, 1\], got 1.5"):
        replace(SPECULATIVE, acceptance=1.5)


def test_hisparse_run_speculative_mode_prints_its_rollbacks() -> None:
    import contextlib
    import io

    from hisparse_core.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["run", "--backend", "reference_cpu", "--requests", "3", "--context", "300", "--decode-tokens",
                     "12", "--steps", "20", "--top-k", "32", "--block-size", "16", "--layers", "2", "--hot", "4",
                     "--rows-per-request", "3", "--acceptance", "0.4", "--gpu-kv", "3MiB", "--host", "8MiB",
                     "--no-progress"]) == 0
    text = out.getvalue()
    line = next(x for x in text.splitlines() if x.strip().startswith("speculative"))
    assert "rolled back" in line and "acceptance 0.4" in line and not line.split()[1].startswith("0 "), line
