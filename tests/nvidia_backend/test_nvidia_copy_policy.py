"""Which miss copy follows a resolve, decided on the host (CPU only: no kernel runs here); and the
backend's on/off knobs, which take 0 or 1 only.

Batches the speculative gather covers in one pass get it alone; a larger batch gets it for as many
first rows as its blocks fit on the SMs the resolver leaves free, the plan copy taking the rest;
and the knobs that change that reject bad values in one line.
"""

from __future__ import annotations

import pytest

from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import RuntimeConfig

# The runtime module imports cuda.bindings at its top; a contributor without the nvidia extra skips.
pytest.importorskip("cuda.bindings", reason="cuda-python not installed: pip install 'hisparse[nvidia]'")

from hisparse_nvidia.kernels import CopyShape  # noqa: E402
from hisparse_nvidia.runtime import NvidiaRuntime, spec_early_exit, spec_kernel  # noqa: E402

SMS = 132  # an H200


def _policy(top_k: int = 2048, blocks_per_sm: int = 4) -> NvidiaRuntime:
    """A runtime with only what the copy policy reads (built without a GPU)."""
    rt = object.__new__(NvidiaRuntime)
    rt.config = RuntimeConfig(max_batch_rows=128, max_requests=128, top_k=top_k, hot_rows=4096, block_size=64,
                              max_pages=512)
    rt._copy_shape = CopyShape(656)
    rt._overlap = True
    rt._spec_per_sm = blocks_per_sm
    rt._spec_rows, _ = rt._speculative_rows(SMS)
    rt._follow = True
    rt._split = rt._spec_rows > 0
    rt._early_exit = True
    rt._spec_kernel = "auto"
    rt._gather_blocks, rt._gather_fit, rt._gather_smem, rt._gather_per_sm = SMS, 5, 116736, 1  # as on an H200
    return rt


def test_speculative_rows_default_and_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 blocks of 256 threads x 4 slots per SM, 48 slots a 656-byte row: 11 rows of top-k 2048.
    assert _policy()._spec_rows == 8 * SMS * 1024 // (2048 * 48) == 11
    monkeypatch.setenv("HISPARSE_SPEC_BLOCKS_PER_SM", "4")
    assert _policy()._spec_rows == 5
    monkeypatch.setenv("HISPARSE_SPEC_ROWS", "3")
    assert _policy()._spec_rows == 3
    monkeypatch.setenv("HISPARSE_SPEC_ROWS", "0")
    rt = _policy()
    assert rt._spec_rows == 0 and rt._speculative_rows(SMS) == (0, "HISPARSE_SPEC_ROWS=0")
    monkeypatch.delenv("HISPARSE_SPEC_ROWS")
    assert _policy(top_k=2040)._speculative_rows(SMS) == (0, "top_k is not a multiple of 32")


@pytest.mark.parametrize(("name", "value"), [("HISPARSE_SPEC_BLOCKS_PER_SM", "33"), ("HISPARSE_SPEC_BLOCKS_PER_SM", "-1"),
                                             ("HISPARSE_SPEC_BLOCKS_PER_SM", "x"), ("HISPARSE_SPEC_ROWS", "-2")])
def test_bad_knob_values_are_one_line_errors(name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidInputError) as err:
        _policy()
    assert name in str(err.value) and value in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("1", True), ("0", False), ("yes", None), ("", None)])
def test_spec_early_exit_knob(value: str | None, expected: bool | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if value is not None:
        monkeypatch.setenv("HISPARSE_SPEC_EARLY_EXIT", value)
    if expected is not None:
        assert spec_early_exit() is expected
        return
    with pytest.raises(InvalidInputError) as err:
        spec_early_exit()
    assert f"HISPARSE_SPEC_EARLY_EXIT={value!r}" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["HISPARSE_OVERLAP_LAUNCH", "HISPARSE_GATHER_FOLLOW", "HISPARSE_SPEC_SPLIT",
                                  "HISPARSE_SPEC_GATHER"])
@pytest.mark.parametrize("value", ["false", "off", "no", "", " 0"])
def test_switch_knobs_refuse_what_is_not_0_or_1(name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read as `!= "0"`, `HISPARSE_OVERLAP_LAUNCH=false` (or off, no) left the switch on, silently;
    each is one line naming the variable, as HISPARSE_SPEC_EARLY_EXIT's bad values are."""
    from hisparse_nvidia.runtime import copy_switches

    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidInputError) as err:
        copy_switches() if name != "HISPARSE_SPEC_GATHER" else _policy()  # read in __init__ / _speculative_rows
    assert str(err.value) == f"{name}={value!r}: expected 1 (the default) or 0"


@pytest.mark.parametrize("name", ["HISPARSE_OVERLAP_LAUNCH", "HISPARSE_GATHER_FOLLOW", "HISPARSE_SPEC_SPLIT",
                                  "HISPARSE_SPEC_GATHER"])
def test_switch_knobs_take_0_and_1(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from hisparse_nvidia.settings import copy_switches, env_switch

    assert env_switch(name) is True and copy_switches() == (True, True, True)
    for value, on in (("1", True), ("0", False)):
        monkeypatch.setenv(name, value)
        assert env_switch(name) is on
    monkeypatch.setenv(name, "0")
    if name == "HISPARSE_SPEC_GATHER":
        assert _policy()._speculative_rows(SMS) == (0, "HISPARSE_SPEC_GATHER=0")
    else:
        switches = dict(zip(("HISPARSE_OVERLAP_LAUNCH", "HISPARSE_GATHER_FOLLOW", "HISPARSE_SPEC_SPLIT"),
                            copy_switches(), strict=True))
        assert switches == {n: n != name for n in switches}


@pytest.mark.parametrize(("value", "expected"), [(None, "auto"), ("slots", "slots"), ("entries", "entries"),
                                               ("auto", "auto"), ("slot", None)])
def test_spec_kernel_knob(value: str | None, expected: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if value is not None:
        monkeypatch.setenv("HISPARSE_SPEC_KERNEL", value)
    if expected is not None:
        assert spec_kernel() == expected
        return
    with pytest.raises(InvalidInputError) as err:
        spec_kernel()
    assert "HISPARSE_SPEC_KERNEL='slot'" in str(err.value) and "\n" not in str(err.value)


# The plan copy's 132 blocks, 5 to an SM, are padded to one an SM where fewer than 27 SMs are free,
# and then wait for the whole resolver unless a split's speculative rows come first.
@pytest.mark.parametrize(("b", "resolver_sms", "choice"), [
    (8, 64, (8, None, False, False)),  # within the speculative gather's one pass: it takes the whole batch
    (12, 96, (1, 1, True, False)),     # cluster resolver on 96 SMs: 36 free hold 144 blocks, one row's 96
    (15, 120, (0, 0, False, True)),    # 12 free SMs: 48 blocks, half a row: the plan copy takes the batch
    (16, 16, (4, 4, True, False)),     # one block a row: 116 free SMs hold 464 blocks, 4 rows of 96
    (32, 32, (4, 4, True, False)),     # 100 free: 400 blocks
    (64, 64, (2, 2, True, False)),     # 68 free: 272 blocks
    (100, 100, (1, 1, True, False)),   # 32 free: 128 blocks
    (106, 106, (1, 1, True, True)),    # 26 free: 104 blocks; 130 of the plan copy's
    (128, 128, (0, 0, False, True)),   # 4 free: padded, waiting for the whole resolver
])
def test_split_covers_the_rows_that_fit_beside_the_resolver(b: int, resolver_sms: int,
                                                             choice: tuple[int, int | None, bool, bool]) -> None:
    rt = _policy()
    assert rt._copy_choice(b, True, SMS - resolver_sms) == choice
    rows, plan_from, _, _ = choice
    if plan_from:  # every block of the split's speculative copy fits at once on the free SMs
        assert -(-rows * 2048 * 48 // 1024) <= (SMS - resolver_sms) * rt._spec_per_sm
    assert rt._copy_choice(b, False, SMS - resolver_sms) == (0, None, False, False)  # no copy asked


def test_no_padding_when_the_limit_is_off() -> None:
    rt = _policy()
    rt._gather_smem = 0  # HISPARSE_GATHER_PER_SM=0, or a kernel that fits one block an SM anyway
    assert rt._copy_choice(128, True, 4) == (0, 0, True, False)  # not padded: it follows the resolver


def test_split_off_or_no_follow_leaves_the_plan_copy_alone() -> None:
    rt = _policy()
    rt._split = False
    assert rt._copy_choice(32, True, 100) == (0, 0, True, False)
    rt._follow = False
    assert rt._copy_choice(32, True, 100) == (0, 0, False, False)
    assert rt._copy_choice(8, True, 68) == (8, None, False, False)


def test_split_never_takes_the_whole_batch() -> None:
    rt = _policy(blocks_per_sm=32)  # a kernel so small that every row would fit
    assert rt._split_rows(rt._spec_rows + 1, SMS) == rt._spec_rows
    assert all(rt._split_rows(b, SMS) < b for b in range(1, 40))


def test_the_log_says_which_copy_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _policy()
    rt._gather_blocks, rt._prefetch_blocks, rt._follow, rt._split = SMS, SMS // 2, True, True
    assert rt._describe_copies("") == (
        "miss copies after a resolve start while it runs for batches of up to 11 rows (by slots at 1 row, entries "
        "above; blocks that can hold no miss leave without waiting for the resolver); larger batches so for as "
        "many first rows as fit on the SMs the resolver leaves free (4 blocks to an SM), the other rows by a "
        "persistent grid of 132 blocks (66 in a prefetch, HISPARSE_PREFETCH_GATHER_BLOCKS; up to 5 an SM; when the resolver leaves too few free SMs for all of them, "
        "1 an SM (116736 bytes of shared memory a block, HISPARSE_GATHER_PER_SM), after the whole resolver) that "
        "copies each request's plan once the resolver has published it")
    rt._gather_smem = 0
    rt._split = False
    assert rt._describe_copies("").endswith("(HISPARSE_SPEC_SPLIT=0 or HISPARSE_GATHER_FOLLOW=0)")
    rt._early_exit = False
    rt._spec_kernel = "slots"
    assert ("(by slots, HISPARSE_SPEC_KERNEL; every block waits for the resolver (HISPARSE_SPEC_EARLY_EXIT=0))"
            in rt._describe_copies(""))
    monkeypatch.setenv("HISPARSE_SPEC_GATHER", "0")
    rt._spec_rows, why = rt._speculative_rows(SMS)
    rt._follow = False
    assert rt._describe_copies(why) == (
        "miss copies after a resolve: a persistent grid of 132 blocks (66 in a prefetch, "
        "HISPARSE_PREFETCH_GATHER_BLOCKS; up to 5 an SM) that waits for the whole "
        "resolver (HISPARSE_GATHER_FOLLOW=0) (no speculative gather: HISPARSE_SPEC_GATHER=0)")


class _Occupancy:
    """A plan-copy kernel as the occupancy API sees it: an H200 SM's 228 KiB of shared memory, 1 KiB
    reserved a block, allocated in 128-byte units, and at most 8 blocks of 256 threads."""

    static_smem = 32

    def __init__(self) -> None:
        self.allowed = 48 * 1024

    def allow_dynamic_smem(self, nbytes: int) -> None:
        assert nbytes + self.static_smem <= 227 * 1024, nbytes  # the device's per-block limit
        self.allowed = max(self.allowed, nbytes)

    def max_active_blocks(self, block: int, smem: int) -> int:
        assert block == 256 and smem <= self.allowed
        return min(8, 233472 // (-(-smem // 128) * 128 + 1024))


@pytest.mark.parametrize("per_sm", [1, 2, 3, 5, 7])
def test_gather_per_sm_asks_for_the_least_shared_memory_that_keeps_the_limit(
        per_sm: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _policy()
    rt._k_gather = k = _Occupancy()
    rt._gather_fit = k.max_active_blocks(256, (128 + 1) * 4)
    monkeypatch.setenv("HISPARSE_GATHER_PER_SM", str(per_sm))
    smem, fits = rt._gather_shared_memory(227 * 1024)
    assert fits == per_sm == k.max_active_blocks(256, smem)
    assert k.max_active_blocks(256, smem - 16) > per_sm  # 16 bytes less lets one more block in
    assert smem >= (rt.config.max_batch_rows + 1) * 4


def test_gather_per_sm_default_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _policy()
    rt._k_gather = k = _Occupancy()
    rt._gather_fit = k.max_active_blocks(256, (128 + 1) * 4)
    smem, fits = rt._gather_shared_memory(227 * 1024)  # default: one block an SM where padded
    assert fits == 1 and smem > 0
    monkeypatch.setenv("HISPARSE_GATHER_PER_SM", "0")
    assert rt._gather_shared_memory(227 * 1024) == (0, 8)  # no limit: nothing padded
    monkeypatch.setenv("HISPARSE_GATHER_PER_SM", "8")
    assert rt._gather_shared_memory(227 * 1024) == (0, 8)  # as many as fit anyway
    for bad in ("33", "-1", "x"):
        monkeypatch.setenv("HISPARSE_GATHER_PER_SM", bad)
        with pytest.raises(InvalidInputError) as err:
            rt._gather_shared_memory(227 * 1024)
        assert "HISPARSE_GATHER_PER_SM" in str(err.value) and bad in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("value", "expected"), [(None, False), ("0", False), ("1", True), ("true", None),
                                               ("yes", None), ("", None)])
def test_unregister_at_exit_takes_0_or_1(value: str | None, expected: bool | None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`HISPARSE_UNREGISTER_AT_EXIT=true` was read at exit as `!= "1"`: off, silently. A pool's
    construction now says a bad value in one line (here the check alone: a pool needs a GPU)."""
    from hisparse_nvidia.host_pool import unregister_at_exit

    monkeypatch.delenv("HISPARSE_UNREGISTER_AT_EXIT", raising=False)
    if value is not None:
        monkeypatch.setenv("HISPARSE_UNREGISTER_AT_EXIT", value)
    if expected is not None:
        assert unregister_at_exit() is expected
        return
    with pytest.raises(InvalidInputError) as err:
        unregister_at_exit()
    assert str(err.value) == f"HISPARSE_UNREGISTER_AT_EXIT={value!r}: expected 0 (the default) or 1"
