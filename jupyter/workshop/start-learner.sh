#!/bin/sh
# A learner's single-user JupyterLab on the workshop's hub (jupyterhub_config.py: Spawner.cmd). Runs as the learner:
# the first time, copies the course's notebooks into ~/ddp-lessons/notebooks (their own copy, which JupyterLab
# autosaves; the installed course stays read-only), then starts the server from the course's environment.
set -eu
course="$(cd "$(dirname "$0")/../.." && pwd)"
mine="$HOME/ddp-lessons/notebooks"
if [ ! -d "$mine" ]; then
    umask 077
    mkdir -p "$mine"
    cp "$course"/notebooks/*.ipynb "$mine"/
fi
# The course's environment: its Python must be one every learner may run (ensure_env.sh with PYTHON=/usr/bin/python3,
# not a Python in root's home); DDP_LESSONS_PYTHON names another (jupyterhub_config.py passes it on).
exec "${DDP_LESSONS_PYTHON:-$course/.venv/bin/python}" -m jupyterhub.singleuser "$@"
