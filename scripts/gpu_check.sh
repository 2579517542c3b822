#!/usr/bin/env bash
# The GPU check: the course's nccl path on a machine with NVIDIA GPUs, on the torch installed there, offline.
#
#   scripts/gpu_check.sh --bundle   here, with PyPI: puts the pure-Python packages the check needs beside
#                                   torch (IPython, nbformat, ipywidgets, tqdm, py-spy and theirs) in
#                                   gpu_check_wheels/ (a few MiB); copy the project with it to the GPU machine
#   scripts/gpu_check.sh            there: installs from gpu_check_wheels/ what its Python lacks, into
#                                   .venv-gpu-check (which sees that Python's own torch, numpy and matplotlib),
#                                   then runs scripts/gpu_check.py: one line per check and a summary
#
# PYTHON picks the interpreter that holds the torch to check (default python3). Exit code: 0 every check
# held, 1 one failed, 3 no GPU found (it says what it would run; nothing is installed).
set -euo pipefail
project_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
wheels="$project_root/gpu_check_wheels"
# pyproject.toml's dependencies without torch, numpy and matplotlib (every PyTorch GPU image has them; binary
# wheels for one Python only) and without JupyterLab's server side (the check runs no browser).
packages=(ipython ipywidgets nbformat tqdm py-spy)

if [ "${1:-}" = "--bundle" ]; then
    rm -rf "$wheels"
    # Pure-Python wheels fit any Python 3; the few binary ones (rpds-py for nbformat's jsonschema) are fetched
    # for each Python a GPU image may hold.
    for version in 3.10 3.11 3.12 3.13; do
        "$python" -m pip download --quiet --dest "$wheels" --only-binary=:all: --python-version "$version" \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 "${packages[@]}"
    done
    echo "gpu_check_wheels/: $(ls "$wheels" | wc -l) wheels, $(du -sm "$wheels" | cut -f1) MiB. Copy the project with it to the GPU machine and run scripts/gpu_check.sh there."
    exit 0
elif [ $# -ne 0 ]; then
    echo "Usage: scripts/gpu_check.sh [--bundle]" >&2
    exit 2
fi

gpus="$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || true)"
if ! [[ "$gpus" =~ ^[0-9]+$ ]]; then
    echo "No torch in '$python': set PYTHON=/path/to/the/python/that/has/torch." >&2
    exit 2
fi
if [ "$gpus" = "0" ]; then  # the plan, from the check itself (it needs only torch), without installing anything
    exec "$python" "$project_root/scripts/gpu_check.py"
fi
for module in numpy matplotlib; do
    "$python" -c "import $module" 2>/dev/null || {
        echo "'$python' has no $module: install it beside torch (pip install $module), then run this again." >&2
        exit 2
    }
done
venv="$project_root/.venv-gpu-check"
[ -x "$venv/bin/python" ] || "$python" -m venv --system-site-packages "$venv"
if ! "$venv/bin/python" -c 'import IPython, nbformat, ipywidgets, tqdm' 2>/dev/null; then
    if [ ! -d "$wheels" ]; then
        echo "gpu_check_wheels/ is missing: run scripts/gpu_check.sh --bundle where PyPI is reachable, and copy it here." >&2
        exit 2
    fi
    "$venv/bin/python" -m pip install --quiet --no-index --find-links "$wheels" "${packages[@]}"
fi
export PATH="$venv/bin:$PATH" PYTHONPATH="$project_root${PYTHONPATH:+:$PYTHONPATH}"
exec "$venv/bin/python" "$project_root/scripts/gpu_check.py"
