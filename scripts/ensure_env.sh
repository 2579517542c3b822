#!/usr/bin/env bash
# Sourced by the other scripts: makes sure .venv exists and holds what pyproject.toml asks for, with the
# tested torch. Re-installs only when pyproject.toml or the torch asked for changed since the last install
# (a stamp file records them).
#   DDP_LESSONS_TORCH=2.10.0 scripts/run_tests.sh ...   the same, in .venv-torch-2.10.0 with that torch
#   (PyPI's build: on Linux x86_64 a CUDA build, several GB, which runs on CPU too)
# Which torch build, on the first install: with an NVIDIA GPU (nvidia-smi lists one), PyPI's (a CUDA build);
# without one, PyTorch's CPU-only build (about 200 MB instead of several GB) from its CPU index, when that index
# answers within a few seconds (else PyPI's, saying why). It says which and why. To choose:
#   DDP_LESSONS_TORCH_INDEX=pypi scripts/launch_lesson.sh 0       PyPI's build, whatever the machine
#   DDP_LESSONS_TORCH_INDEX=cpu scripts/launch_lesson.sh 0        the CPU-only build
#   DDP_LESSONS_TORCH_INDEX=https://... scripts/launch_lesson.sh 0   torch from that package index
#   (everything else always comes from PyPI). DDP_LESSONS_EXTRAS=test adds the test tools (run_tests.sh does).
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
cpu_index="${DDP_LESSONS_CPU_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"  # PyTorch's CPU-only builds
torch_index="${DDP_LESSONS_TORCH_INDEX:-}"
case "$torch_index" in
    cpu) torch_index="$cpu_index" ;;
    pypi|"") torch_index="" ;;
    *) if ! [[ "$torch_index" =~ ^(https?|file)://[^[:space:]]+$ ]]; then
           echo "DDP_LESSONS_TORCH_INDEX is cpu, pypi, or the address of a package index, such as https://download.pytorch.org/whl/cpu (got '$torch_index')." >&2
           exit 2
       fi ;;
esac
extras="${DDP_LESSONS_EXTRAS:-}"
if [ -n "$extras" ] && ! [[ "$extras" =~ ^[a-z]+$ ]]; then
    echo "DDP_LESSONS_EXTRAS names an extra of pyproject.toml, such as test (got '$extras')." >&2
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
# The stamp: what was installed (pyproject's hash, the torch, where it came from), then the extras.
stamp_file="$venv/.ddp-lessons-installed"
installed="$(cat "$stamp_file" 2>/dev/null || true)"
installed_extras="${installed##* extras=}"
[ "$installed_extras" != "$installed" ] || installed_extras=""
project_stamp="$(sha256sum "$project_root/pyproject.toml" | cut -d' ' -f1) torch==$torch_version"
if [ "${installed%% from=*}" != "$project_stamp" ] \
        || { [ -n "${DDP_LESSONS_TORCH_INDEX:-}" ] && [[ "$installed" != *" from=${torch_index:-pypi} "* ]]; } \
        || { [ -n "$extras" ] && [[ ",$installed_extras," != *",$extras,"* ]]; }; then
    if [ -z "${DDP_LESSONS_TORCH_INDEX:-}" ]; then
        if nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
            echo "An NVIDIA GPU is here: torch $torch_version comes from PyPI (its CUDA build, several GB)." \
                 "DDP_LESSONS_TORCH_INDEX=cpu chooses the CPU-only build instead." >&2
        elif "$python_for_venv" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
                "$cpu_index/" >/dev/null 2>&1; then
            torch_index="$cpu_index"
            echo "No NVIDIA GPU here: torch $torch_version comes as PyTorch's CPU-only build (about 200 MB) from" \
                 "$cpu_index. DDP_LESSONS_TORCH_INDEX=pypi chooses PyPI's CUDA build instead." >&2
        else
            echo "No NVIDIA GPU here, but PyTorch's CPU index ($cpu_index) did not answer: torch $torch_version" \
                 "comes from your usual package index (PyPI's is a CUDA build of several GB on Linux x86_64; it runs on" \
                 "CPU too). DDP_LESSONS_TORCH_INDEX=cpu insists on the CPU-only build." >&2
        fi
    fi
    if [ -n "$torch_index" ]; then  # torch alone from that index (its builds carry a local tag: 2.13.0+cpu)
        "$venv/bin/python" -m pip install --quiet --index-url "$torch_index" "torch==$torch_version" >&2
    fi
    all_extras="$(printf '%s\n' ${installed_extras//,/ } $extras | sort -u | paste -sd, -)"
    # One resolve: pyproject's range admits the torch asked for, or pip says they conflict.
    "$venv/bin/python" -m pip install --quiet "torch==$torch_version" -e "$project_root${all_extras:+[$all_extras]}" >&2
    echo "$project_stamp from=${torch_index:-pypi} extras=$all_extras" > "$stamp_file"
fi
# JupyterLab settings the project ships: pip installs them with the package; refreshed here when
# jupyter/overrides.json changed since (an editable install copies them only once).
lab_settings="$venv/share/jupyter/lab/settings"
if ! cmp -s "$project_root/jupyter/overrides.json" "$lab_settings/overrides.json"; then
    mkdir -p "$lab_settings"
    cp "$project_root/jupyter/overrides.json" "$lab_settings/overrides.json"
fi
export PATH="$venv/bin:$PATH"
