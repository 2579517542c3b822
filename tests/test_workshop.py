"""A workshop on one machine: JupyterHub with the project's own configuration (jupyter/workshop/), three learners as
real Unix users, the course installed read-only (this checkout, root's), each learner logged in through headless
Chromium and running lesson 0 at the same time. One learner solves the exercise, one leaves it as given, one only
runs the lesson. Then: every run finished, the instructor's progress table names the right learner as solved, no
learner can read another's runs or signal another's processes, every port a learner's processes listen on is on
loopback, and once the hub stops nothing of any learner is left running.

Needs root (to make the learners and run the hub), Debian's chromium and configurable-http-proxy (npm; .ci/run
installs both); skipped without root."""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support import free_port

ROOT = Path(__file__).resolve().parent.parent
LEARNERS = ("ddp-lessons-ada", "ddp-lessons-ben", "ddp-lessons-cy")  # solves the exercise, leaves it, only runs
HOMES = Path("/var/tmp/ddp-lessons-workshop")
PROXY = ROOT / "jupyter" / "workshop" / "node_modules" / ".bin" / "configurable-http-proxy"
SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="a workshop's learners are Unix users: making them needs root"),
              pytest.mark.xdist_group("workshop")]


def proxy_command() -> str:
    found = shutil.which("configurable-http-proxy") or (str(PROXY) if PROXY.exists() else None)
    if not found:
        pytest.fail("JupyterHub's proxy is missing: `npm install --prefix jupyter/workshop configurable-http-proxy` "
                    "(.ci/run does it)")
    return found


def make_learner(name: str) -> pwd.struct_passwd:
    """A learner's account with a fresh, empty home of their own."""
    HOMES.mkdir(mode=0o755, exist_ok=True)
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--home-dir", str(HOMES / name), "--shell", "/bin/sh", name],
                       check=True, capture_output=True)
        account = pwd.getpwnam(name)
    subprocess.run(["pkill", "-KILL", "-u", name], check=False)
    shutil.rmtree(account.pw_dir, ignore_errors=True)
    Path(account.pw_dir).mkdir(mode=0o700)
    os.chown(account.pw_dir, account.pw_uid, account.pw_gid)
    return account


def as_learner(account: pwd.struct_passwd, command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups",
                           *command], env={"PATH": "/usr/bin:/bin", "HOME": account.pw_dir}, cwd="/",
                          capture_output=True, text=True, timeout=60)


class Hub:
    """JupyterHub as root with the workshop's configuration, on free loopback ports, its state in a folder of its
    own; stopped (SIGTERM, which stops the learners' servers too) at the end."""

    def __init__(self, state: Path, password: str, learners: list[str], python: Path):
        self.port, api, proxy_api = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (state / "learners").write_text("\n".join(learners) + "\n")
        env = {**os.environ, "DDP_LESSONS_HUB_STATE": str(state), "DDP_LESSONS_HUB_PORT": str(self.port),
               "DDP_LESSONS_HUB_API_PORT": str(api), "DDP_LESSONS_HUB_PROXY_PORT": str(proxy_api),
               "DDP_LESSONS_HUB_PROXY": proxy_command(), "DDP_LESSONS_HUB_LEARNERS": str(state / "learners"),
               "DDP_LESSONS_HUB_TEST_PASSWORD": password, "DDP_LESSONS_PYTHON": str(python)}
        for name in ("DDP_HELPERS_RUNS", "DDP_LESSONS_COURSE_UNDER_TEST"):  # the tests' own: not the learners'
            env.pop(name, None)
        self.log_path = state / "hub.log"
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen([str(Path(sys.executable).parent / "jupyterhub"), "-f",
                                         str(ROOT / "jupyter" / "workshop" / "jupyterhub_config.py")],
                                        cwd=state, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 90
        while "JupyterHub is now running" not in self.log_path.read_text():
            assert self.process.poll() is None, f"the hub exited:\n{self.log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the hub did not start:\n{self.log_path.read_text()[-3000:]}"
            time.sleep(0.3)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def learners_python(folder: Path) -> Path:
    """A Python every learner may run, with the course's environment: this suite's venv may sit on a Python in
    root's home (pyenv), which a learner cannot execute; a workshop builds its environment on the system's Python
    (README). Here: a venv on /usr/bin/python3 that loads this venv's packages (the same CPython minor version)."""
    system = Path("/usr/bin/python3")
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    found = subprocess.run([str(system), "-c", "import sys; print(f'{sys.version_info.major}.{sys.version_info.minor}')"],
                           capture_output=True, text=True) if system.exists() else None
    if not found or found.stdout.strip() != mine:
        pytest.skip(f"no system Python {mine} that learners may run")
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(folder)], check=True)
    packages = next(Path(sys.prefix).glob("lib/python*/site-packages"))
    (next(folder.glob("lib/python*/site-packages")) / "course.pth").write_text(
        f"import site; site.addsitedir({str(packages)!r})\n")
    for data in ("etc/jupyter", "share/jupyter"):  # JupyterLab's server extension and settings, found by sys.prefix
        (folder / data).parent.mkdir(parents=True, exist_ok=True)
        (folder / data).symlink_to(Path(sys.prefix) / data)
    folder.chmod(0o755)
    return folder / "bin" / "python"


def solve_the_exercise(account: pwd.struct_passwd) -> None:
    """The learner's own copy of lesson 0 with the exercise solved (as they would type it), owned by them."""
    import nbformat

    path = Path(account.pw_dir) / "ddp-lessons" / "notebooks" / "00_check_setup.ipynb"
    notebook = nbformat.read(path, as_version=4)
    cell = next(c for c in notebook.cells if c.source.startswith("%%torchrun --nproc 2 --backend gloo --name exercise"))
    cell.source = cell.source.replace(
        "mean = number  # every rank should end with the mean of all the ranks' numbers",
        "mean = number.clone()\ndist.all_reduce(mean)\nmean /= world_size")
    assert "dist.all_reduce(mean)" in cell.source
    nbformat.write(notebook, path)


def log_in_and_run_lesson_0(browser, hub: Hub, name: str, password: str):
    page = browser.new_context(viewport={"width": 1300, "height": 900}).new_page()
    page.goto(f"{hub.url}/hub/login")
    page.fill("input[name=username]", name)
    page.fill("input[name=password]", password)
    page.click("input[type=submit], button[type=submit]")
    # The hub starts the learner's server, then JupyterLab opens lesson 0 (the configuration's default URL).
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell", timeout=150_000)
    return page


def run_all_at_once(pages, timeout_s: float = 600) -> None:
    """Run All in every page, then wait until every page's cells have all run, or its Run All stopped at an error:
    test_browser's `run_all_cells`, for several pages at once (Run All asked again of a kernel that was still
    connecting and dropped it, while at most its first cell ran)."""
    import re

    from test_browser import RUN_ALL_STOPPED_S, prompts_js

    state_js = prompts_js("return {total: prompts.length, unrun: prompts.filter(t => t === '[ ]:').length,"
                          " running: prompts.filter(t => t === '[*]:').length};")

    def run_all(page) -> None:
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()

    requests, stalled_since, finished = {}, {}, set()
    for index, page in enumerate(pages):
        run_all(page)
        requests[index], stalled_since[index] = 1, time.monotonic()
    deadline = time.monotonic() + timeout_s
    while len(finished) < len(pages):
        for index, page in enumerate(pages):
            if index in finished:
                continue
            state = page.evaluate(state_js)
            ran = state["total"] - state["unrun"] - state["running"]
            if state["total"] and not state["unrun"] and not state["running"]:
                finished.add(index)
            elif state["running"]:
                stalled_since[index] = time.monotonic()
            elif ran > 1 and time.monotonic() - stalled_since[index] > RUN_ALL_STOPPED_S:
                finished.add(index)  # stopped at an error: the saved notebook says which cell
            elif ran <= 1 and requests[index] < 4 and time.monotonic() - stalled_since[index] > 15:
                run_all(page)
                requests[index], stalled_since[index] = requests[index] + 1, time.monotonic()
        assert time.monotonic() < deadline, f"lesson 0 not done in every learner's JupyterLab after {timeout_s} s"
        time.sleep(0.5)


def test_three_learners_run_lesson_0_at_once_on_one_hub(tmp_path):
    from playwright.sync_api import sync_playwright

    from test_browser import CHROMIUM_FLAGS, PANEL, cells_that_failed_or_never_ran, find_chromium, saved_notebook

    learners = [make_learner(name) for name in LEARNERS]
    environment = Path(f"/var/tmp/ddp-lessons-workshop-env-{os.getpid()}")
    python = learners_python(environment)
    state = tmp_path / "hub"
    state.mkdir(mode=0o700)
    password = secrets.token_urlsafe(12)
    # Each learner's notebooks are copied at their first start; the solving learner's copy is made first, by the
    # same script, as them, and solved.
    copied = as_learner(learners[0], ["/usr/bin/env", f"DDP_LESSONS_PYTHON={python}",
                                      f"{ROOT}/jupyter/workshop/start-learner.sh", "--version"])
    assert copied.returncode == 0, copied.stderr
    solve_the_exercise(learners[0])
    hub = Hub(state, password, list(LEARNERS), python)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=find_chromium(), headless=True, args=CHROMIUM_FLAGS)
            pages = [log_in_and_run_lesson_0(browser, hub, name, password) for name in LEARNERS]
            for page in pages:  # Run All in every learner's lesson, so that the three run at once
                page.wait_for_function(
                    "(panel) => document.querySelector(panel + ' .jp-Notebook-ExecutionIndicator')?.dataset.status"
                    " === 'idle'", arg=PANEL, timeout=120_000)
            run_all_at_once(pages)
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            texts = []
            for account, page in zip(learners, pages):
                page.screenshot(path=str(SCREENSHOTS / f"workshop-{account.pw_name}.png"))
                # As the learner's JupyterLab saved it, in their home: every output, each with its type.
                saved = saved_notebook(page, Path(account.pw_dir) / "ddp-lessons" / "notebooks" / "00_check_setup.ipynb")
                problems = cells_that_failed_or_never_ran(saved)
                assert not problems, f"{account.pw_name}'s lesson 0:\n" + "\n".join(problems)[:3000]
                texts.append("\n".join(str(output.get("text", "")) + json.dumps(output.get("data", {}))
                                       for cell in saved["cells"] for output in cell.get("outputs", [])))
            browser.close()
        for name, text in zip(LEARNERS, texts):
            assert "Set-up works: 2 ranks started" in text, f"{name}'s lesson 0:\n{text[-3000:]}"
        assert "All checks pass" in texts[0], texts[0][-2000:]
        assert "mistake to fix" in texts[1] and "mistake to fix" in texts[2], texts[1][-2000:]
        check_learners_are_apart(learners)
        check_no_learner_gets_into_anothers_server(learners, hub)
    except BaseException:
        print(f"the hub's log, the end:\n{hub.log_path.read_text()[-6000:]}")
        raise
    finally:
        hub.stop()
        shutil.rmtree(environment, ignore_errors=True)
    deadline = time.monotonic() + 30  # the servers' kernels and their warm processes end as the servers do
    while True:
        left = {account.pw_name: subprocess.run(["pgrep", "-u", account.pw_name], capture_output=True,
                                                text=True).stdout.split() for account in learners}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not any(left.values()), f"processes of the learners still running after the hub stopped: {left}"
    table = subprocess.run([sys.executable, "-m", "ddp_helpers.course.progress", *LEARNERS], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:]}
    column = table.stdout.splitlines()[0].index("lesson 0")
    assert rows[LEARNERS[0]][column:].startswith("exercise ✓"), table.stdout
    assert rows[LEARNERS[1]][column:].startswith("exercise not yet"), table.stdout
    assert rows[LEARNERS[2]][column:].startswith("exercise not yet"), table.stdout


def check_learners_are_apart(learners) -> None:
    """While the learners' servers run: none can list or read another's runs, or signal another's processes; every
    socket a learner's process listens on is bound to loopback."""
    runs = {account.pw_name: Path(account.pw_dir) / ".cache" / "ddp-helpers" / "runs" for account in learners}
    for account in learners:
        assert runs[account.pw_name].is_dir(), f"{account.pw_name} has no runs folder of their own"
        for other in learners:
            if other is account:
                continue
            listing = as_learner(account, ["ls", str(runs[other.pw_name])])
            assert listing.returncode != 0, f"{account.pw_name} can list {other.pw_name}'s runs"
            pids = subprocess.run(["pgrep", "-u", other.pw_name], capture_output=True, text=True).stdout.split()
            assert pids, f"{other.pw_name} has nothing running"
            signalled = as_learner(account, ["kill", "-0", pids[0]])
            assert signalled.returncode != 0, f"{account.pw_name} can signal {other.pw_name}'s process {pids[0]}"
    listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout.splitlines()
    learner_pids = {pid for account in learners
                    for pid in subprocess.run(["pgrep", "-u", account.pw_name], capture_output=True, text=True).stdout.split()}
    theirs = [line for line in listening if any(f"pid={pid}," in line for pid in learner_pids)]
    assert len(theirs) >= len(learners), f"each learner's server listens somewhere: {listening}"
    for line in theirs:
        address = line.split()[3].rsplit(":", 1)[0]
        assert address in ("127.0.0.1", "[::1]", "::1"), f"a learner's process listens beyond loopback: {line}"


def check_no_learner_gets_into_anothers_server(learners, hub: Hub) -> None:
    """Each learner's JupyterLab listens on loopback, where every user of the machine can connect: as every other
    learner, its API answers without the learner's token with a refusal, never with their files."""
    import re

    # The single-user servers' own line: "[I ... ServerApp] http://127.0.0.1:PORT/user/NAME/lab/...?token=..."
    servers = dict(re.findall(r"ServerApp\] http://127\.0\.0\.1:(\d+)/user/([\w-]+)/", hub.log_path.read_text()))
    servers = {name: int(port) for port, name in servers.items()}
    assert set(servers) == {account.pw_name for account in learners}, f"the learners' servers: {servers}"
    probe = textwrap.dedent('''
        import sys, urllib.request, urllib.error
        for port, name in zip(sys.argv[1::2], sys.argv[2::2]):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/user/{name}/api/contents", timeout=10) as reply:
                    print(name, reply.status)
            except urllib.error.HTTPError as error:
                print(name, error.code)
    ''')
    for account in learners:
        others = [item for name, port in servers.items() if name != account.pw_name for item in (str(port), name)]
        answered = as_learner(account, ["/usr/bin/python3", "-c", probe, *others])
        assert answered.returncode == 0, answered.stderr
        codes = dict(line.split() for line in answered.stdout.splitlines())
        assert codes and all(code in ("403", "401", "302") for code in codes.values()), \
            f"{account.pw_name} reached another learner's server: {codes}"
