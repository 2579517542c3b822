#!/usr/bin/env bash
# Sourced by the other scripts: makes sure .venv exists and holds what pyproject.toml asks for.
# Re-installs only when pyproject.toml changed since the last install (a stamp file records its hash).
set -euo pipefail
project_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$project_root/.venv"
python_for_venv="${PYTHON:-python3}"

if ! "$python_for_venv" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "DDP Lessons needs Python 3.10 or newer as '$python_for_venv' (set PYTHON=/path/to/python3.x to choose one)." >&2
    exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
    echo "Creating the environment in $venv (first run only; a few minutes) ..." >&2
    "$python_for_venv" -m venv "$venv"
fi
wanted_stamp="$(sha256sum "$project_root/pyproject.toml" | cut -d' ' -f1)"
stamp_file="$venv/.ddp-lessons-installed"
if [ "$(cat "$stamp_file" 2>/dev/null)" != "$wanted_stamp" ]; then
    "$venv/bin/python" -m pip install --quiet -e "$project_root[test]" >&2
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
