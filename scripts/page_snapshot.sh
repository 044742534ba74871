#!/usr/bin/env bash
# The page /gpucleanup drawn from a recorded answer of its API (tests/tools/page_snapshot.py), as a PNG.
# Installs what it needs first (scripts/setup.sh: Chromium, chromedriver, Selenium and tornado in .venv).
# Usage: scripts/page_snapshot.sh RECORDED.json OUT.png [--width N]
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: scripts/page_snapshot.sh RECORDED.json OUT.png [--width N]" >&2; exit 2; }
bash scripts/setup.sh >/dev/null
exec .venv/bin/python tests/tools/page_snapshot.py "$@"
