#!/usr/bin/env bash
# The course's static site, built offline into test-artifacts/site/ (or --out DIR) from executed notebooks: the
# suite's browser test saves them in test-artifacts/executed/ (or --executed DIR); with none there, this runs
# each lesson first, as nbmake does (several minutes on 2 cores: it says so). Serve the folder with any static
# host, e.g. python3 -m http.server --bind 127.0.0.1 -d test-artifacts/site. website/build.py says more.
set -euo pipefail
DDP_LESSONS_EXTRAS=site  # Sphinx, MyST-NB and the Furo theme come with the site only
source "$(dirname "${BASH_SOURCE[0]}")/ensure_env.sh"
cd "$project_root"
exec python website/build.py --execute-missing "$@"
