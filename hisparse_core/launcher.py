"""The `hisparse` console script (and `python -m hisparse_core`).

It imports the CLI inside `main`, so Ctrl-C while the CLI still loads (its first ~0.1 s) ends as
Ctrl-C later in a run does: one line, exit status 130, no traceback. A plain `import
hisparse_core.cli` elsewhere keeps Python's own KeyboardInterrupt.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from hisparse_core.cli import main as cli_main
    except KeyboardInterrupt:
        print("hisparse: interrupted", file=sys.stderr)
        return 130
    return cli_main()
