"""Nothing in tests/ may shadow an installed package's import name.

tests/conftest.py puts tests/ on sys.path, so a folder there named like a package (tests/vllm was
one) imports as a namespace package wherever the real one is missing, and an
`importorskip("vllm")` passes instead of skipping.
"""

from __future__ import annotations

from importlib.metadata import packages_distributions
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
#: Import names of packages the tests may meet, installed here or not (the optional extras).
OPTIONAL = {"vllm", "transformers", "nixl", "cuda", "matplotlib", "hypothesis", "torch", "numpy", "pluggy"}


def test_no_test_folder_or_module_is_named_like_a_package() -> None:
    names = {p.stem for p in TESTS.iterdir() if p.is_dir() or p.suffix == ".py"} - {"__pycache__", "conftest"}
    taken = sorted(names & (OPTIONAL | set(packages_distributions())))
    assert not taken, f"tests/ holds {taken}, which shadow installed or optional packages; rename them"
