"""The platform-neutral pieces every backend shares: argument checks, resolve checks, row groups,
copy and transfer-engine checks (the /dev/shm pool-file protocol has test_shm_protocol.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from core_support import subprocess_env
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_core.checks import check_int, check_range, check_sequence, check_span, check_tensor
from hisparse_core.copy_checks import check_host_copies, check_mirrors, check_pages
from hisparse_core.errors import InvalidInputError, ProtocolError
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.resolve_checks import check_resolve_shapes, check_resolve_values
from hisparse_core.row_groups import Group, groups_of
from hisparse_core.runtime import ResolveInputs
from hisparse_core.transfer_checks import check_engine_runtimes, check_unique_ids
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror

CPU = torch.device("cpu")
CFG = RuntimeConfig(max_batch_rows=4, max_requests=3, top_k=2, hot_rows=8, block_size=4, max_pages=3,
                    rows_per_request=2)


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def inputs(topk: list[list[int]], row_state: list[int], seq_lens: list[int]) -> ResolveInputs:
    tables = torch.full((3, 3), -1, dtype=torch.int32)
    return ResolveInputs(torch.tensor(topk, dtype=torch.int32), i32(*row_state), i32(*seq_lens), tables.clone(),
                         tables.clone(), torch.zeros((3, 2), dtype=torch.int32))


# ----------------------------------------------------------------- primitive checks

def test_check_int_rejects_bool_and_out_of_range() -> None:
    assert check_int("n", 3, 0, 4) == 3
    with pytest.raises(InvalidInputError, match=r"n must be an int, got True \(bool\)"):
        check_int("n", True, 0, 4)
    with pytest.raises(InvalidInputError, match=r"n=4 is out of range; expected \[0, 4\)"):
        check_int("n", 4, 0, 4)


def test_check_range_names_first_offender_with_its_index() -> None:
    with pytest.raises(InvalidInputError, match=r"t\[\(1, 0\)\]=9 is out of range; expected \[0, 5\)"):
        check_range("t", torch.tensor([[0, 1], [9, 9]]), 0, 5)


def test_check_tensor_and_sequence_and_span() -> None:
    with pytest.raises(InvalidInputError, match=r"t has shape \[2\]; expected \[\*, 2\]"):
        check_tensor("t", i32(1, 2), (None, 2), torch.int32, CPU)
    with pytest.raises(InvalidInputError, match=r"xs\[1\] must be a int, got str"):
        check_sequence("xs", [1, "a"], int)
    with pytest.raises(InvalidInputError, match="cross a block boundary"):
        check_span("m", 3, 2, 100, 4)
    with pytest.raises(InvalidInputError, match="exceed the 4 rows bound"):
        check_span("m", 2, 3, 4, 8)


# ----------------------------------------------------------------- groups and resolve checks

def test_groups_are_maximal_runs_without_padding() -> None:
    assert groups_of(i32(-1, 2, 2, -1, 1, 2)) == [Group(1, 3, 2), Group(4, 5, 1), Group(5, 6, 2)]


def test_resolve_shapes_use_the_backends_tensor_check() -> None:
    seen: list[str] = []

    def strict(name: str, t: object, shape: tuple[int | None, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        seen.append(name)
        return check_tensor(name, t, shape, dtype, device)

    assert check_resolve_shapes(inputs([[0, 1]], [0], [2]), CFG, CPU, tensor_check=strict) == 1
    assert seen == ["topk", "row_state", "seq_lens", "source_table", "resident_table", "hot_table"]


def test_resolve_values_reject_split_groups_and_ignore_padding_rows() -> None:
    with pytest.raises(InvalidInputError, match="state row 1 appears in two groups"):
        check_resolve_values(inputs([[0, 1]] * 3, [1, 0, 1], [2] * 3), CFG, num_device_blocks=4, host_blocks=4)
    # A padding row's garbage topk and seq_lens are never read.
    check_resolve_values(inputs([[0, 1], [99, -7]], [0, -1], [2, -5]), CFG, num_device_blocks=4, host_blocks=4)


# ----------------------------------------------------------------- copy and transfer checks

@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 6)), min_size=1, max_size=6),
       st.integers(1, 8), st.integers(1, 48), st.integers(1, 48))
def test_check_mirrors_accepts_and_refuses_what_check_span_does(spans: list[tuple[int, int, int]], bs: int,
                                                                dev_rows: int, host_rows: int) -> None:
    # check_mirrors tests the spans inline (no message built for a good one): the same verdicts
    # and the same message as check_span on each side, in order.
    expect: list[tuple[int, int, int]] | str = []
    for i, (src, dst, n) in enumerate(spans):
        try:
            check_span(f"mirrors[{i}] source", src, n, dev_rows, bs)
            check_span(f"mirrors[{i}] destination", dst, n, host_rows, bs)
        except InvalidInputError as exc:
            expect = str(exc)
            break
        assert isinstance(expect, list)
        expect.append((src, dst, n))
    mirrors = [RowMirror((src,), dst, n) for src, dst, n in spans]
    try:
        got: list[tuple[int, int, int]] | str = check_mirrors(mirrors, resident_group=0, block_size=bs,
                                                              device_rows=dev_rows, host_rows=host_rows)
    except InvalidInputError as exc:
        got = str(exc)
    assert got == expect


def test_copy_checks_return_plain_integers_and_name_bad_fields() -> None:
    assert check_mirrors([RowMirror((5,), 9, 2)], resident_group=0, block_size=4, device_rows=16,
                         host_rows=16) == [(5, 9, 2)]
    with pytest.raises(InvalidInputError, match=r"mirrors\[0\].source_starts has 1 entries"):
        check_mirrors([RowMirror((5,), 9, 2)], resident_group=1, block_size=4, device_rows=16, host_rows=16)
    spill = PageTransfer(7, 1, (2,), restore=False)
    assert check_pages([spill], restore=None, resident_group=0, device_blocks=4, host_blocks=4) == [(2, 1)]
    with pytest.raises(InvalidInputError, match=r"\(id 7\) has restore=False; pass it to spill_pages"):
        check_pages([spill], restore=True, resident_group=0, device_blocks=4, host_blocks=4)
    with pytest.raises(InvalidInputError, match=r"copies\[0\].dst_block_id=4 is out of range"):
        check_host_copies([HostBlockCopy(0, 4)], host_blocks=4)


class _Rt:
    def __init__(self, bound: bool) -> None:
        self.bound = bound


def test_engine_runtimes_run_the_backend_hook_per_runtime_in_order() -> None:
    calls: list[int] = []
    assert len(check_engine_runtimes([_Rt(True), _Rt(True)], _Rt, "a _Rt", lambda i, _rt: calls.append(i))) == 2
    assert calls == [0, 1]
    with pytest.raises(InvalidInputError, match=r"runtimes\[0\] is not bound"):
        check_engine_runtimes([_Rt(False)], _Rt, "a _Rt")
    with pytest.raises(InvalidInputError, match=r"runtimes\[0\] is an int; expected a _Rt"):
        check_engine_runtimes([1], _Rt, "a _Rt")


def test_unique_ids_cover_the_batch_and_everything_in_flight() -> None:
    check_unique_ids("transfer id", [1, 2], {3})
    for ids, in_flight in (([1, 1], set()), ([3], {3})):
        with pytest.raises(ProtocolError, match="still unacknowledged"):
            check_unique_ids("transfer id", ids, in_flight)


# ----------------------------------------------------------------- torch-free helpers

@pytest.mark.parametrize("module", ["hisparse_core.shm", "hisparse_core.capacity",
                                    "hisparse_core.transfer_checks"])
def test_file_and_engine_helpers_import_no_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
