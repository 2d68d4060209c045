"""bench/kernel_timeline.py's summary of a kernel timeline (the profiler's records need a GPU; the
arithmetic over them does not)."""

from __future__ import annotations

from pathlib import Path

from bench_scripts import imported

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernel_timeline.py"


def test_summary_reads_durations_overlaps_and_the_period() -> None:
    with imported(SCRIPT) as kt:
        span = kt.KernelSpan
        # Two steps: a resolver, then a copy launched 3 us before the resolver ends; the next resolver 1 us after the copy.
        spans = [span("resolve_split_kernel", 0.0, 10.0), span("copy_spec_kernel(int*, int)", 7.0, 14.0),
                 span("resolve_split_kernel", 15.0, 25.0), span("copy_spec_kernel(int*, int)", 22.0, 29.0)]
        lines = kt.summary(spans)
    assert "resolve_split_kernel: 10.00 us (x2)" in lines
    assert "copy_spec_kernel: 7.00 us (x2)" in lines
    assert "resolve_split_kernel -> copy_spec_kernel: starts -3.00 us from its end (x2)" in lines
    assert "copy_spec_kernel -> resolve_split_kernel: starts +1.00 us from its end (x1)" in lines
    assert lines[-1] == "period of resolve_split_kernel: 15.00 us"


def test_no_records_is_said_not_summarised() -> None:
    with imported(SCRIPT) as kt:
        assert kt.summary([]) == ["no kernel records (is the CUDA profiler available here?)"]
