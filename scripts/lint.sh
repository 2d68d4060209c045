#!/usr/bin/env bash
# The static checks contributors and CI run: ruff (lint and import order) on the whole tree, then
# mypy on hisparse_core and the in-repo backends and plugins (both configured in pyproject.toml;
# mypy is strict on the public interfaces), then the test suite collected with every optional extra
# hidden (scripts/collect_without_extras.py: what a contributor with `.[test]` alone meets). All
# three always run; the exit status is non-zero if any fails.
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
echo "== pytest --collect-only with the extras hidden (scripts/collect_without_extras.py)"
if ! collected=$(python scripts/collect_without_extras.py 2>&1); then
    printf '%s\n' "$collected" | grep -v '::' >&2
    status=1
fi
if [ "$status" -ne 0 ]; then
    echo "lint: failed (see the ruff, mypy and collection output above)" >&2
fi
exit "$status"
