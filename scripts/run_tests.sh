#!/usr/bin/env bash
# The whole test suite: the library's tests, and every notebook run in JupyterLab (tests/test_browser.py).
# Extra arguments go to pytest, e.g. scripts/run_tests.sh -k magic, or
# scripts/run_tests.sh --nbmake notebooks/02_ddp_basics.ipynb to run one lesson under nbmake.
set -euo pipefail
DDP_LESSONS_EXTRAS=test  # the test tools (pytest, Playwright, nbmake) come with the test command only
source "$(dirname "${BASH_SOURCE[0]}")/ensure_env.sh"
cd "$project_root"
exec python -m pytest "$@"
