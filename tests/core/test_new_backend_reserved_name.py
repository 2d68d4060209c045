"""`hisparse new-backend auto` (any case) is refused before anything is written. Before, it wrote
a distribution whose closing line said "select it with --backend auto", but `auto` asks for
automatic selection wherever a backend name is taken, so that backend could never be selected."""

from __future__ import annotations

from pathlib import Path

import pytest

from hisparse_core import cli
from hisparse_core.errors import InvalidInputError
from hisparse_core.scaffold import check_name


@pytest.mark.parametrize("name", ["auto", "AUTO", "Auto"])
def test_auto_in_any_case_is_no_backend_name(name: str) -> None:
    with pytest.raises(InvalidInputError, match=rf"backend name '{name}' is reserved: 'auto', in any case, asks for "
                                                r"automatic selection"):
        check_name(name, ["reference_cpu"])


def test_new_backend_auto_is_one_line_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "auto"
    assert cli.main(["new-backend", "auto", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hisparse new-backend: error: backend name 'auto' is reserved"), err
    assert not target.exists()


def test_names_that_only_contain_auto_are_still_names() -> None:
    assert check_name("autox", ["reference_cpu"]).package == "hisparse_autox"
