"""`python bench/bench_locality.py` (docs/results.md's command): a bad value is one line naming the
flag, the value and what was expected, exit 2, before any trace is drawn."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import imported

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_locality.py"


@pytest.mark.parametrize(("argv", "line"), [
    (["--hot", "nan"], "argument --hot: expected a multiple of top-k in [1, 64], got nan"),
    (["--hot", "inf"], "argument --hot: expected a multiple of top-k in [1, 64], got inf"),
    (["--seed", "-1"], "argument --seed: expected an integer in [0, 4294967295], got -1"),
    (["--resident-budget", "-1"], "argument --resident-budget: expected an integer in [0, 61], got -1"),
    (["--top-k", "0"], "argument --top-k: expected an integer in [1, 65536], got 0"),
    (["--steps", "40"], "argument --steps: expected an integer in [--warmup + 1 = 41, 16777216], got 40"),
    (["--backend", "nope"], "--backend 'nope': no hisparse backend named 'nope'"),
    (["--no-policies", "--no-replay"], "argument --no-replay: not allowed with --no-policies: nothing would be "
                                       "measured; expected one of the two at most"),
    # the replay's budgets follow from these: the engine's refusals, in `hisparse run`'s flags, were a
    # traceback after the policy tables
    (["--no-policies", "--top-k", "65536"], "--requests 2 and --top-k 65536 make a replay of 4 requests of 2097152+24 tokens that "
                           "cannot run here (--top-k 65536 with --hot 2 makes a hot buffer of 131072 rows"),
    (["--no-policies", "--requests", "65536"], "--requests 65536 and --top-k 256 make a replay of 131072 requests of 8192+24 tokens "
                              "that cannot run here ("),
])
def test_a_bad_value_is_one_line(argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--hot nan` and `--hot inf` passed the script's own check and ended in a ValueError or
    OverflowError traceback, as did `--seed -1`, `--resident-budget -1` (an InvalidInputError) and
    `--backend nope` (after the policy tables); `--no-policies --no-replay` measured nothing and
    exited 0."""
    with imported(SCRIPT) as script, pytest.raises(SystemExit) as exit_:
        script.main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"bench_locality: error: {line}"), err


def test_the_replays_host_pool_holds_every_request() -> None:
    """Every request of the replay runs at once and holds all its pages in the host pool, which was 1 GiB
    whatever --requests and --top-k: `--requests 40 --top-k 512` failed mid-run (a CapacityError
    traceback, `this step writes ... new pages but the host pool has 25574 allocatable blocks`)."""
    import argparse

    with imported(SCRIPT) as script:
        for requests, top_k in ((2, 256), (40, 512)):
            for config in script.replay_configs(argparse.Namespace(requests=requests, top_k=top_k, seed=0)):
                block = 4 * 16 * config.fmt.row_bytes
                pages = -(-config.max_tokens // 16)
                assert config.host_bytes // block >= config.requests * (pages + config.tail_pages) + 1
                assert config.host_bytes >= 1 << 30
