"""`hisparse_core.units.human_bytes`: the one byte formatter of capacity errors and the CLI tables."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from hisparse_core import capacity
from hisparse_core.errors import CapacityError
from hisparse_core.replay import report
from hisparse_core.units import human_bytes


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
                                    (512 << 20, "512.00 MiB"), (34359738368, "32.00 GiB"), (1 << 40, "1.00 TiB"),
                                    (1 << 60, "1024.00 PiB"), (None, "n/a"), (math.nan, "n/a")])
def test_figures(n: float | None, text: str) -> None:
    assert human_bytes(n) == text


def test_integers_past_2_53_round_from_their_exact_value() -> None:
    """52.625 PiB plus one byte is above the tie, so 52.63; `float(n)` (exact only up to 2**53)
    dropped the byte and the tie rounded to even, 52.62: more than half a unit off."""
    tie = 421 << 47   # 52.625 PiB
    assert human_bytes(tie) == "52.62 PiB"   # an exact tie: half to even, as float formatting
    assert human_bytes(tie + 1) == "52.63 PiB"
    assert human_bytes(tie - 1) == "52.62 PiB"
    assert human_bytes(-(tie + 1)) == "-52.63 PiB"


@given(st.integers(0, 1 << 62))
@example(53888)            # 52.625 KiB, a tie: 52.62 is exactly half a unit off, which float(value) overstated
@example((421 << 47) + 1)  # 52.625 PiB and a byte: past 2**53, where float(n) drops the byte
def test_reads_back_within_rounding(n: int) -> None:
    """At most half a unit of the last digit off, compared exactly (in floats, 52.62 * 1024 is
    5.12000000000262 bytes from 53888, over the bound it meets exactly)."""
    value, unit = human_bytes(n).split()
    scale = 1 << (10 * ["B", "KiB", "MiB", "GiB", "TiB", "PiB"].index(unit))
    assert abs(Fraction(value) * scale - n) <= Fraction(scale, 200)
    assert float(value) <= 1024 or unit == "PiB"  # 1024.00 only where two decimals round up


def test_one_formatter_for_tables_and_capacity_errors() -> None:
    assert report.human_bytes is human_bytes
    with pytest.raises(CapacityError, match=r"^GPU KV needs 1\.00 TiB \(1099511627776 B\) of host RAM; "):
        capacity.check_device_memory(torch.device("cpu"), 1 << 40, "GPU KV")
