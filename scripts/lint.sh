#!/usr/bin/env bash
# The static checks contributors and CI run: ruff (lint and import order) on the whole tree, then
# mypy on hisparse_core and the in-repo backends and plugins (both configured in pyproject.toml;
# mypy is strict on the public interfaces). Both always run; the exit status is non-zero if either
# fails.
#
#   pip install -e '.[lint]'     # ruff and the pinned mypy
#   bash scripts/lint.sh
set -u
cd "$(dirname "$0")/.."

for tool in ruff mypy; do
    if ! command -v "$tool" >/dev/null; then
        echo "lint: $tool is not installed; expected it on PATH (pip install -e '.[lint]')" >&2
        exit 2
    fi
done

status=0
echo "== ruff check ."
ruff check . || status=1
echo "== mypy (config: pyproject.toml [tool.mypy])"
mypy || status=1
if [ "$status" -ne 0 ]; then
    echo "lint: failed (see the ruff and mypy output above)" >&2
fi
exit "$status"
