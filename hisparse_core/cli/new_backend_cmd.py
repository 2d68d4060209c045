"""`hisparse new-backend NAME [DIR]`: write an out-of-tree backend distribution to start from.

The distribution (pyproject.toml with the `hisparse.backends` entry point, the package with
`plugin.py` and `backend.py`, and `ci/conformance.sh`) installs with `pip install -e DIR` and
passes the conformance suite unchanged: every part delegates to reference_cpu until the vendor
replaces it. A bad NAME or a non-empty DIR is one error line and exit status 2, nothing written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "new-backend", help="write a new out-of-tree backend distribution (scaffold) to start from",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", metavar="NAME",
                   help="backend name: a Python identifier not used by an installed backend (e.g. acme)")
    p.add_argument("dir", metavar="DIR", nargs="?", default=None,
                   help="new or empty folder to write into (default: ./hisparse-NAME)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from hisparse_core.errors import HiSparseError
    from hisparse_core.registry import get_registry
    from hisparse_core.scaffold import check_name, write

    target: Path | None = None
    if args.dir == "":  # Path("") is the current folder: an empty DIR (an unset variable) would write there
        print("hisparse new-backend: error: DIR '' is empty; expected a new or empty folder (`.` for the current "
              "one)", file=sys.stderr)
        return 2
    try:
        names = check_name(args.name, (e.name for e in get_registry().entries()))
        target = Path(args.dir if args.dir is not None else names.dist)
        # Checks that DIR is absent (under a writable folder) or empty before writing anything,
        # and removes what it wrote if a write fails.
        write(names, target, label="DIR")
    except HiSparseError as exc:
        print(f"hisparse new-backend: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a check that could not look (a folder that cannot be read, say)
        where = f"DIR {str(target)!r}: " if target is not None else ""
        print(f"hisparse new-backend: error: {where}{exc.strerror or exc}; expected a new or empty folder that "
              "can be written", file=sys.stderr)
        return 2
    print(f"wrote {names.dist} (backend {names.name!r}, package {names.package}) in {target}/")
    from hisparse_core.scaffold import hisparse_source

    source = hisparse_source()
    print("next (hisparse is not on PyPI: the first line puts it into a fresh environment):")
    print(f"  pip install -e '{source}'" if source else "  pip install 'git+https://.../hisparse.git'  "
          "(or a hisparse checkout's path)")
    print(f"  pip install -e '{target}[test]'")
    print("  hisparse backends")
    print(f"  python -m pytest --pyargs hisparse_conformance --hisparse-backend {names.name}")
    print(f"  (or: bash {target}/ci/conformance.sh)")
    print(f"{names.name!r} registers at priority -20, below every shipped backend, so automatic selection does not "
          f"pick it: select it with --backend {names.name}; README.md says how to raise its priority")
    return 0
