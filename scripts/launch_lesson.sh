#!/usr/bin/env bash
# Run lesson N's cells outside Jupyter, under torchrun, from the notebook itself.
#   scripts/launch_lesson.sh 2             the lesson as shipped (git's last commit), even after you edited it
#   scripts/launch_lesson.sh 2 --mine      your edited copy of it
#   scripts/launch_lesson.sh 2 --restore   the shipped lesson back in notebooks/, yours kept in notebooks/my_copies/
# Creates .venv on first use. Ranks: one per GPU (nccl), or CPU processes (gloo) without GPUs.
# Plots are saved as PNG under runs/<notebook>/plots/; exits non-zero if any check fails.
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "Usage: scripts/launch_lesson.sh N [--mine | --restore]   (N: the lesson number, e.g. 2; a deep dive: 2b)" >&2
    exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/ensure_env.sh"
# From the project's root: `python -m` imports from the current folder first, and the one this was started
# in may be writable by others (a shared project folder). The runner works in the notebooks' folder anyway.
cd "$project_root"
exec python -m ddp_helpers.course.lesson_runner "$@"
