"""`hisparse generate`: a tiny random transformers DSA model decodes through hisparse and is
checked against its own generate; the table, the JSON and the error line."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from hisparse_core.cli import main

pytest.importorskip("transformers")

SMALL = ["--backend", "reference_cpu", "--prompts", "3", "--min-prompt", "60", "--max-prompt", "100",
         "--new-tokens", "24", "--layers", "2", "--top-k", "8", "--hot-rows", "16", "--block-size", "4",
         "--prefill-chunk", "8", "--shared-prefix", "16", "--no-progress"]


def _run(*extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["generate", *SMALL, *extra])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_generate_json_is_exact_and_reads_host(family: str) -> None:
    rc, out, _ = _run("--json", "--model", family)
    assert rc == 0
    doc = json.loads(out)
    x, s = doc["exactness"], doc["stats"]
    assert x["exact"] and x["first_batch"]["tokens_identical"] and x["second_batch"]["tokens_identical"]
    assert x["first_batch"]["max_abs_logit_diff"] <= 1e-4 and x["rows_checked"] > 0
    assert s["misses"] > 0 and s["released_pages"] > 0 and s["prefix_hit_tokens"] >= 3 * 16
    assert s["gpu_kv_bytes_per_request"] < s["gpu_kv_bytes_per_request_all_resident"]
    assert doc["engine"]["gpu_pool_pages"] < doc["engine"]["all_resident_pages"]
    if family == "glm_moe_dsa":
        assert doc["engine"]["index_groups"] == [[0, 1]]


def test_generate_table() -> None:
    rc, out, _ = _run()
    assert rc == 0
    for needle in ("tokens/s", "hit rate", "host->device", "device->host", "with hisparse", "without",
                   "tokens identical", "max abs logit diff", "EXACT"):
        assert needle in out, needle


def test_generate_bad_input_is_one_line() -> None:
    rc, out, err = _run("--host-pool-gib", "1e-7")
    assert rc == 2 and not out
    lines = [line for line in err.splitlines() if line.startswith("hisparse generate")]
    assert len(lines) == 1 and "host_pool_gib=1e-07" in lines[0] and "expected host_pool_gib >=" in lines[0]
