"""JupyterHub for a workshop on one machine: each learner a real Unix user, the course installed once, read-only,
in its own environment (`scripts/ensure_env.sh`), each learner's notebooks a copy in their home.

Start it as root from the course's folder (it spawns each learner's server as that learner):
    .venv/bin/jupyterhub -f jupyter/workshop/jupyterhub_config.py
It listens on 127.0.0.1 only: reach it through an SSH tunnel (ssh -L 8000:127.0.0.1:8000 server), or put the
institution's HTTPS reverse proxy in front of it. README, "Running a workshop", says how to add learners and how to
size the machine. Settings a deployment changes come from the environment (DDP_LESSONS_HUB_*), so that the test
that runs this file (tests/test_workshop.py) runs it unchanged.
"""

import os
from pathlib import Path

course = Path(__file__).resolve().parent.parent.parent
state = Path(os.environ.get("DDP_LESSONS_HUB_STATE", "/var/lib/ddp-lessons-hub"))  # root's alone: cookies, database
state.mkdir(mode=0o700, parents=True, exist_ok=True)

c = get_config()  # noqa: F821 - JupyterHub's
c.JupyterHub.ip = "127.0.0.1"  # loopback only: nothing of the workshop is reachable beyond this machine
c.JupyterHub.port = int(os.environ.get("DDP_LESSONS_HUB_PORT", "8000"))
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = int(os.environ.get("DDP_LESSONS_HUB_API_PORT", "8081"))
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{os.environ.get('DDP_LESSONS_HUB_PROXY_PORT', '8001')}"
if os.environ.get("DDP_LESSONS_HUB_PROXY"):  # configurable-http-proxy, where npm put it if not on PATH
    c.ConfigurableHTTPProxy.command = [os.environ["DDP_LESSONS_HUB_PROXY"]]
c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(state / "jupyterhub.pid")
c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")

# Who may log in: the learners' Unix accounts (PAM, their passwords), listed one per line in the file named by
# DDP_LESSONS_HUB_LEARNERS, or all the users in the group named by DDP_LESSONS_HUB_GROUP.
learners_file = os.environ.get("DDP_LESSONS_HUB_LEARNERS")
if learners_file:
    c.Authenticator.allowed_users = {line.strip() for line in Path(learners_file).read_text().splitlines()
                                     if line.strip() and not line.startswith("#")}
if os.environ.get("DDP_LESSONS_HUB_GROUP"):
    c.PAMAuthenticator.allowed_groups = {os.environ["DDP_LESSONS_HUB_GROUP"]}
if os.environ.get("DDP_LESSONS_HUB_TEST_PASSWORD"):  # the test's learners have no password: one for the test only
    c.JupyterHub.authenticator_class = "dummy"
    c.DummyAuthenticator.password = os.environ["DDP_LESSONS_HUB_TEST_PASSWORD"]

# Each learner's server: as the learner (JupyterHub's local process spawner), on loopback, from the course's
# environment, on their own copy of the notebooks; one thread per rank (the machine's cores are shared).
c.Spawner.cmd = [str(course / "jupyter" / "workshop" / "start-learner.sh")]
c.Spawner.ip = "127.0.0.1"
c.Spawner.notebook_dir = "~/ddp-lessons"
c.Spawner.default_url = "/lab/tree/notebooks/00_check_setup.ipynb"
c.Spawner.environment = {"OMP_NUM_THREADS": "1",
                         **({"DDP_LESSONS_PYTHON": os.environ["DDP_LESSONS_PYTHON"]}
                            if os.environ.get("DDP_LESSONS_PYTHON") else {})}
c.Spawner.http_timeout = 120  # a server starting while the machine is busy with the room's runs
c.Spawner.start_timeout = 120
# Memory and cores per learner are enforced by spawners that run each server in a cgroup (systemdspawner:
# c.SystemdSpawner.mem_limit, cpu_limit); the local process spawner only records them. README: how to size.
if os.environ.get("DDP_LESSONS_HUB_MEM_LIMIT"):
    c.Spawner.mem_limit = os.environ["DDP_LESSONS_HUB_MEM_LIMIT"]
c.JupyterHub.shutdown_on_logout = True  # a learner who logs out leaves nothing running
