#!/usr/bin/env bash
# Sourced by the other scripts: makes sure .venv exists and holds what pyproject.toml asks for, with the
# tested torch. Re-installs only when pyproject.toml or the torch asked for changed since the last install
# (a stamp file records them).
#   DDP_LESSONS_TORCH=2.10.0 scripts/run_tests.sh ...   the same, in .venv-torch-2.10.0 with that torch
#   (PyPI's build: on Linux x86_64 a CUDA build, several GB, which runs on CPU too)
#   DDP_LESSONS_TORCH_INDEX=https://download.pytorch.org/whl/cpu scripts/launch_lesson.sh 0
#   takes torch from that package index (PyTorch's CPU-only builds: about 200 MB instead of several GB);
#   everything else still comes from PyPI
set -euo pipefail
project_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The torch the course's own environment installs (environment.yml pins the same; pyproject.toml asks for a
# range around it, so that an install into a learner's environment keeps their torch). tests/test_project.py
# keeps the three in step.
tested_torch="2.13.0"
if [ -n "${DDP_LESSONS_TORCH:-}" ]; then
    if ! [[ "$DDP_LESSONS_TORCH" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
        echo "DDP_LESSONS_TORCH is a torch version such as 2.10.0 (got '$DDP_LESSONS_TORCH')." >&2
        exit 2
    fi
    torch_version="$DDP_LESSONS_TORCH"
    venv="$project_root/.venv-torch-$torch_version"
else
    torch_version="$tested_torch"
    venv="$project_root/.venv"
fi
torch_index="${DDP_LESSONS_TORCH_INDEX:-}"
if [ -n "$torch_index" ] && ! [[ "$torch_index" =~ ^(https?|file)://[^[:space:]]+$ ]]; then
    echo "DDP_LESSONS_TORCH_INDEX is the address of a package index, such as https://download.pytorch.org/whl/cpu (got '$torch_index')." >&2
    exit 2
fi
python_for_venv="${PYTHON:-python3}"

if ! "$python_for_venv" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "DDP Lessons needs Python 3.10 or newer as '$python_for_venv' (set PYTHON=/path/to/python3.x to choose one)." >&2
    exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
    echo "Creating the environment in $venv (first run only; a few minutes) ..." >&2
    "$python_for_venv" -m venv "$venv"
fi
wanted_stamp="$(sha256sum "$project_root/pyproject.toml" | cut -d' ' -f1) torch==$torch_version ${torch_index}"
stamp_file="$venv/.ddp-lessons-installed"
if [ "$(cat "$stamp_file" 2>/dev/null)" != "$wanted_stamp" ]; then
    if [ -n "$torch_index" ]; then  # torch alone from that index (its builds carry a local tag: 2.13.0+cpu)
        "$venv/bin/python" -m pip install --quiet --index-url "$torch_index" "torch==$torch_version" >&2
    fi
    # One resolve: pyproject's range admits the torch asked for, or pip says they conflict.
    "$venv/bin/python" -m pip install --quiet "torch==$torch_version" -e "$project_root[test]" >&2
    echo "$wanted_stamp" > "$stamp_file"
fi
# JupyterLab settings the project ships: pip installs them with the package; refreshed here when
# jupyter/overrides.json changed since (an editable install copies them only once).
lab_settings="$venv/share/jupyter/lab/settings"
if ! cmp -s "$project_root/jupyter/overrides.json" "$lab_settings/overrides.json"; then
    mkdir -p "$lab_settings"
    cp "$project_root/jupyter/overrides.json" "$lab_settings/overrides.json"
fi
export PATH="$venv/bin:$PATH"
