#!/usr/bin/env bash
# The whole test suite: library tests, then every notebook under nbmake (tests/ runs both).
# Extra arguments go to pytest, e.g. scripts/run_tests.sh -k magic
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/ensure_env.sh"
cd "$project_root"
exec python -m pytest "$@"
