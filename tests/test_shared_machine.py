"""A shared machine (a workshop's JupyterHub, a cluster's login node): another Unix user must not be able to
run code as the learner, or swap what the learner's ranks run. The second user is made here (the tests run as
root; elsewhere these tests are skipped) and acts through `setpriv`."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from ddp_helpers.course.lessons.plain_torchrun import run_torchrun_commands, torchrun_in_background, worker_pids

from support import OWN_SOCKETS_SOURCE, free_port

pytestmark = pytest.mark.xdist_group("shared_machine")
OTHER_USER = "ddp-lessons-other"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a second Unix user needs root")


@pytest.fixture(scope="module")
def other_user() -> pwd.struct_passwd:
    """A second Unix user of this machine, with no home and no login."""
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
                       check=True, capture_output=True)
        return pwd.getpwnam(OTHER_USER)


@pytest.fixture
def shared_folder():
    """A folder every user can read and nobody but its owner (this test) can write."""
    folder = Path(tempfile.mkdtemp(prefix="ddp-lessons-shared-"))
    folder.chmod(0o755)
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


def as_user(user: pwd.struct_passwd, command: list[str], extra_env: dict[str, str] | None = None,
            **options) -> subprocess.Popen:
    return subprocess.Popen(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *command],
                            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", **(extra_env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **options)


# The other user's side: find a torchrun agent's rendezvous endpoint on its command line (ps shows it to
# everyone), connect, list the store's keys and overwrite the rendezvous state with a pickle that runs a
# command when unpickled.
ATTACKER = textwrap.dedent(
    '''
    import base64, os, pickle, sys, time
    from datetime import timedelta
    import torch.distributed as dist

    proof, port_wanted = sys.argv[1], int(sys.argv[2])  # the learner's agent (not another job's on this machine)

    class Payload:
        def __reduce__(self):
            return (os.system, (f"id > {proof}",))

    def endpoints():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\\0")
            except OSError:
                continue
            if "--rdzv-endpoint" in argv:
                host, port = argv[argv.index("--rdzv-endpoint") + 1].rsplit(":", 1)
                if int(port) == port_wanted:
                    yield host, int(port)

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for host, port in set(endpoints()):
            try:
                store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=2))
                # the state itself (torch.rendezvous.<id>), not the keys the agents keep below it
                keys = [key for key in store.list_keys() if key.startswith("torch.rendezvous.") and "/" not in key]
            except Exception:
                continue
            for key in keys:
                store.set(key, base64.b64encode(pickle.dumps(Payload())).decode())
                print("wrote", key, flush=True)
                sys.exit(0)
        time.sleep(0.05)
    print("found no rendezvous store", flush=True)
    '''
)


@needs_root
def test_another_user_cannot_run_code_through_a_demos_rendezvous_store(other_user, shared_folder):
    """Lesson 5's lone agent waiting out join_timeout, as the issue's attacker found it: the pickle the other
    user writes into the store is refused unread, and the agent says why."""
    attacker, worker, proof = shared_folder / "attacker.py", shared_folder / "worker.py", shared_folder / "proof"
    attacker.write_text(ATTACKER)
    worker.write_text("print('a worker started')\n")
    for path in (attacker, worker):
        path.chmod(0o644)
    port = free_port()
    attack = as_user(other_user, [sys.executable, str(attacker), str(proof), str(port)])
    try:
        [(code, output)] = run_torchrun_commands(
            [["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "job-42", "--rdzv-conf", "join_timeout=20", str(worker)]], timeout_s=60)
    finally:
        attack_output = attack.communicate(timeout=70)[0]
    assert "wrote torch.rendezvous." in attack_output, f"the attack never reached the store: {attack_output}"
    assert not proof.exists(), f"the other user's pickle ran as the learner: {proof.read_text()}"
    assert code not in (0, None) and "does not carry this job's signature" in output, output[-2000:]


HOLDS_A_GROUP = textwrap.dedent(
    '''
    import time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print("in the group", flush=True)
    time.sleep(60)
    '''
)


@pytest.mark.parametrize("rendezvous", ["standalone", "static"])
def test_every_port_a_demos_torchrun_opens_is_on_loopback(rendezvous, tmp_path):
    """The agent's stores (rendezvous, and the one it shares with its workers) and the workers' sockets."""
    namespace: dict = {}
    exec(OWN_SOCKETS_SOURCE, namespace)
    script = tmp_path / "group.py"
    script.write_text(HOLDS_A_GROUP)
    options = {"standalone": ["--standalone"],
               "static": ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]}
    with torchrun_in_background([*options[rendezvous], "--nproc-per-node", "2", str(script)]) as agent:
        workers = worker_pids(agent, ranks=2)
        seen = ""
        for line in agent.stdout:  # both workers write to one pipe: their lines can merge
            seen += line
            if seen.count("in the group") == 2:
                break
        assert seen.count("in the group") == 2, f"the workers did not form their group: {seen}"
        sockets = [(pid, found) for pid in (agent.pid, *workers.values()) for found in namespace["own_tcp_sockets"](pid)]
    listening = [(pid, found["local"]) for pid, found in sockets if found["state"] == "0A"]
    assert listening, "the agent hosts a store: a listening socket was expected"
    beyond_loopback = [(pid, local) for pid, local in listening if not is_loopback_hex(local)]
    assert beyond_loopback == [], f"listening beyond loopback: {beyond_loopback}"


def is_loopback_hex(local: str) -> bool:
    """127.0.0.0/8 or ::1 (or IPv4-mapped 127.x), as /proc/net/tcp* spell them (little-endian words)."""
    return (len(local) == 8 and local.endswith("7F")) or local == "00000000000000000000000001000000" \
        or (len(local) == 32 and local.startswith("0000000000000000FFFF0000") and local.endswith("7F"))


CELL = "%%torchrun --nproc 2\nimport os\nprint('rank', os.environ['RANK'])\n"


def run_cell(ipython, cell: str = CELL):
    """Run a %%torchrun cell as a learner would; returns IPython's result (its error, if any)."""
    return ipython.run_cell(cell)


@needs_root
def test_a_runs_root_another_user_made_on_shared_scratch_is_refused(ipython, other_user, monkeypatch, capsys):
    """Shared scratch (sticky, as /tmp): the other user made the runs root before the learner, and could swap
    a cell's script there. The launch is refused, says what to set, and writes nothing there."""
    scratch = Path(tempfile.mkdtemp(prefix="ddp-lessons-scratch-"))
    try:
        scratch.chmod(0o1777)
        theirs = scratch / "runs"
        theirs.mkdir(mode=0o777)
        os.chown(theirs, other_user.pw_uid, other_user.pw_gid)
        monkeypatch.setenv("DDP_HELPERS_RUNS", str(theirs))
        result = run_cell(ipython)
        error = str(result.error_in_exec)
        assert "belongs to ddp-lessons-other" in error and "DDP_HELPERS_RUNS" in error, error
        assert list(theirs.iterdir()) == []
    finally:
        subprocess.run(["rm", "-rf", str(scratch)], check=False)


@needs_root
def test_a_symbolic_link_at_the_runs_root_is_not_followed(ipython, other_user, monkeypatch):
    scratch = Path(tempfile.mkdtemp(prefix="ddp-lessons-scratch-"))
    try:
        scratch.chmod(0o1777)
        target = scratch / "their-folder"
        target.mkdir(mode=0o777)
        link = scratch / "runs"
        link.symlink_to(target)
        os.lchown(link, other_user.pw_uid, other_user.pw_gid)
        monkeypatch.setenv("DDP_HELPERS_RUNS", str(link))
        error = str(run_cell(ipython).error_in_exec)
        assert "symbolic link" in error and "DDP_HELPERS_RUNS" in error, error
        assert list(target.iterdir()) == []
    finally:
        subprocess.run(["rm", "-rf", str(scratch)], check=False)


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_runs_root_others_can_write_is_refused(ipython, tmp_path, monkeypatch, mode):
    root = tmp_path / "runs"
    root.mkdir()
    root.chmod(mode)
    monkeypatch.setenv("DDP_HELPERS_RUNS", str(root))
    error = str(run_cell(ipython).error_in_exec)
    assert "can be written by other users" in error and "DDP_HELPERS_RUNS" in error, error
    assert list(root.iterdir()) == []


def test_a_folder_above_the_runs_root_others_can_write_without_the_sticky_bit_is_refused(ipython, tmp_path,
                                                                                         monkeypatch):
    above = tmp_path / "group-scratch"
    above.mkdir()
    above.chmod(0o775)
    monkeypatch.setenv("DDP_HELPERS_RUNS", str(above / "runs"))
    error = str(run_cell(ipython).error_in_exec)
    assert f"{above} can be written by other users" in error, error
    assert not (above / "runs").exists()


@pytest.mark.parametrize("umask", [0o002, 0o000])
def test_every_folder_and_file_a_launch_makes_is_private_whatever_the_umask(ipython, tmp_path, monkeypatch, umask):
    """Under umask 002 (a shared group), a group member could replace a cell's script in a folder of mode 775;
    under 000 anyone could read a rank's output, or write into the files the launcher reads back."""
    root = tmp_path / "runs"
    monkeypatch.setenv("DDP_HELPERS_RUNS", str(root))
    old = os.umask(umask)
    try:
        result = run_cell(ipython)
    finally:
        os.umask(old)
    assert result.success, result.error_in_exec
    folders = [root, *(path for path in root.rglob("*") if path.is_dir())]
    assert len(folders) >= 4  # the root, the notebook's, its scripts/ and the cell's script folder, its run folder
    loose = {str(path): oct(path.stat().st_mode & 0o777) for path in folders if path.stat().st_mode & 0o077}
    assert loose == {}
    files = [path for path in root.rglob("*") if not path.is_dir() and not path.is_symlink()]
    assert len(files) >= 5  # the script, the marker, each rank's output and record
    loose = {str(path.relative_to(root)): oct(path.stat().st_mode & 0o777) for path in files if path.stat().st_mode & 0o077}
    assert loose == {}


def _readable_by_others(path: Path) -> bool:
    return all(part.stat().st_mode & 0o005 == 0o005 for part in [path, *path.parents])


def python_for_others() -> tuple[str, dict[str, str]]:
    """A Python the other user can run, with this environment's packages: this one, or (when it lives where
    others cannot read, as pyenv's under /root) the system's of the same version, pointed at them."""
    import site
    import sysconfig

    own = Path(os.path.realpath(sys.executable))
    if _readable_by_others(own.parent):
        return sys.executable, {}
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    packages = Path(sysconfig.get_paths()["purelib"])
    if not (system.exists() and _readable_by_others(packages)):
        pytest.skip("no Python here that another user can run with this environment's packages")
    return str(system), {"PYTHONPATH": os.pathsep.join([str(packages), *site.getsitepackages()])}


def _run_a_cell_as(user: pwd.struct_passwd, folder: Path, extra_env: dict[str, str] | None = None) -> str:
    """Run CELL in an IPython shell of `user`, with ddp_helpers imported from this project (which belongs to
    this test's user: a shared install the other user cannot write); returns what the shell printed."""
    project = Path(__file__).resolve().parent.parent
    if not _readable_by_others(project):
        pytest.skip("the project is not readable by other users here")
    python, env = python_for_others()
    program = folder / "cell.py"
    program.write_text(textwrap.dedent(
        f'''
        import sys
        sys.path.insert(0, {str(project)!r})
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "ddp_helpers")
        shell.run_cell({CELL!r})
        '''))
    program.chmod(0o644)
    shell = as_user(user, [python, str(program)], cwd=folder, extra_env={**env, **(extra_env or {})})
    return shell.communicate(timeout=120)[0]


@needs_root
def test_a_read_only_install_runs_a_learners_cells_in_their_own_cache(other_user, shared_folder):
    """The course installed by an administrator (the learner cannot write its runs/), no DDP_HELPERS_RUNS: the
    learner's cells run, their files in a folder of their own under their home, said once; nothing is written
    into the install, and none of the learner's processes is left."""
    home = Path(tempfile.mkdtemp(prefix="ddp-lessons-home-"))
    try:
        os.chown(home, other_user.pw_uid, other_user.pw_gid)
        home.chmod(0o700)
        project_runs = Path(__file__).resolve().parent.parent / "runs"
        before = sorted(project_runs.rglob("*")) if project_runs.exists() else []
        output = _run_a_cell_as(other_user, shared_folder, {"HOME": str(home)})
        root = home / ".cache" / "ddp-helpers" / "runs"
        assert "rank 0" in output and "rank 1" in output and "Traceback" not in output, output
        assert output.count(f"runs go to {root}") == 1, output
        made = [root, *root.rglob("*")]
        assert len(made) > 3 and all(p.lstat().st_uid == other_user.pw_uid for p in made), made
        assert all(p.lstat().st_mode & 0o077 == 0 for p in made if p.is_dir()), "the learner's folders are theirs alone"
        assert (sorted(project_runs.rglob("*")) if project_runs.exists() else []) == before
        left = subprocess.run(["pgrep", "-u", str(other_user.pw_uid)], capture_output=True, text=True).stdout.split()
        assert not left, f"processes of the learner left running: {left}"
    finally:
        subprocess.run(["pkill", "-9", "-u", str(other_user.pw_uid)], check=False)
        subprocess.run(["rm", "-rf", str(home)], check=False)


@needs_root
def test_a_read_only_install_for_a_user_with_no_home_says_to_set_the_runs_folder(other_user, shared_folder):
    """The same install for a user with no home of their own (HOME=/tmp): nowhere private to default to, so one
    clear error that says what to set."""
    output = _run_a_cell_as(other_user, shared_folder)
    assert "DDP_HELPERS_RUNS" in output and "Traceback" not in output and "PermissionError" not in output, output
    assert len(output.strip().splitlines()) <= 3, output


HIDES_A_CHILD = textwrap.dedent(
    '''
    import ctypes, os, time
    from ddp_helpers import record
    if os.environ["RANK"] == "0":
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # a new session, another name: nothing of the run's marks left on it but what the sweep records
            os.setsid()
            ctypes.CDLL(None).prctl(15, b"innocent", 0, 0, 0)  # PR_SET_NAME
            os.write(write_end, b"x")
            time.sleep(300)
            os._exit(0)
        os.read(read_end, 1)
        record("hidden", pid)
    '''
)


@pytest.mark.parametrize("how", ["warm", "cold"])
def test_a_child_that_leaves_the_session_and_renames_itself_does_not_survive_the_run(how, write_script):
    from ddp_helpers.processes import process_is_dead
    from support import run_on_cpu

    run = run_on_cpu(write_script("hides", HIDES_A_CHILD), cold=how == "cold")
    assert run.ok, run.summary()
    hidden = run.ranks[0].facts["hidden"]
    survived = not process_is_dead(hidden)
    if survived:
        os.kill(hidden, 9)
    assert not survived, f"the renamed child {hidden} of a {how} rank outlived the run"


def test_a_demos_torchrun_leaves_no_torchelastic_folder(tmp_path, monkeypatch):
    """torchrun makes a folder per run (its workers' error files) in the temporary folder unless given --log-dir."""
    import tempfile as tempfile_module

    from ddp_helpers.course.lessons.plain_torchrun import run_torchrun_command

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    monkeypatch.setattr(tempfile_module, "tempdir", None)  # read TMPDIR again
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    code, output = run_torchrun_command(["--standalone", "--nproc-per-node", "2", str(script)])
    assert code == 0, output
    assert list(temporary.iterdir()) == []


@needs_root
def test_a_group_member_cannot_replace_a_cells_script_under_umask_002(ipython, other_user, shared_folder,
                                                                      monkeypatch):
    """A shared group and umask 002, as on many clusters: the other user, in the learner's group, tries to put
    their own script where the ranks read the cell's (the folders above the runs root let everyone through)."""
    root = shared_folder / "runs"
    monkeypatch.setenv("DDP_HELPERS_RUNS", str(root))
    old = os.umask(0o002)
    try:
        result = run_cell(ipython)
    finally:
        os.umask(old)
    assert result.success, result.error_in_exec
    scripts = [path for path in root.rglob("*.py")]
    assert scripts, "the cell's script was written"
    group = os.stat(scripts[0]).st_gid
    attempt = subprocess.run(
        ["setpriv", f"--reuid={other_user.pw_uid}", f"--regid={other_user.pw_gid}", f"--groups={group}",
         "sh", "-c", f"echo 'print(\"not yours\")' > {scripts[0].parent}/swap.py && mv {scripts[0].parent}/swap.py "
                     f"{scripts[0]}"], capture_output=True, text=True)
    assert attempt.returncode != 0, "a member of the learner's group replaced the cell's script"
    assert "not yours" not in scripts[0].read_text()


WAITS_IN_A_GROUP = """\
import os, time
import torch.distributed as dist
dist.init_process_group("gloo")
print("in the group", flush=True)
deadline = time.monotonic() + 90
while not os.path.exists(os.environ["RELEASE"]) and time.monotonic() < deadline:  # the attack is over
    time.sleep(0.1)
dist.destroy_process_group()
"""


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(") ", 1)[1].split()[1])


def listening_ports_of(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (IPv4 and IPv6)."""
    namespace: dict = {}
    exec(OWN_SOCKETS_SOURCE, namespace)
    return {found["port"] for found in namespace["own_tcp_sockets"](pid) if found["state"] == "0A"}


@needs_root
def test_another_user_cannot_run_code_through_the_launchers_rendezvous_store(other_user, shared_folder, write_script,
                                                                            tmp_path):
    """The launcher's own agents keep their rendezvous state in a store on loopback, which any local user can
    reach and list (the attacker is handed the run's listening ports, as a scan of /proc/net/tcp finds them):
    a pickle written there is refused unread."""
    import threading
    import time

    from ddp_helpers.processes import marked_processes
    from ddp_helpers.run_folder import MARKER_NAME, RUN_ID_ENV, RunFolder, read_json
    from support import run_on_cpu

    attacker, proof = shared_folder / "attacker.py", shared_folder / "proof"
    attacker.write_text(ATTACK_PORTS)
    attacker.chmod(0o644)
    run_dir = tmp_path / "run"
    result = {}
    release = tmp_path / "release"
    launch = threading.Thread(target=lambda: result.update(run=run_on_cpu(
        write_script("waits", WAITS_IN_A_GROUP), run_dir=run_dir, timeout_s=120, extra_env={"RELEASE": str(release)})))
    launch.start()
    try:
        deadline, ports = time.monotonic() + 60, set()
        while not ports and time.monotonic() < deadline and launch.is_alive():
            output = run_dir / "rank0.stdout"
            run_id = (read_json(run_dir / MARKER_NAME) or {}).get("run_id")
            if run_id and output.exists() and "in the group" in output.read_text():
                # The agent (the supervisor): marked itself when cold, the parent of the ranks' stubs when warm.
                # Not the ranks (gloo's sockets are no store), nor this process.
                marked = set(marked_processes(run_id, RUN_ID_ENV))
                ranks = set(RunFolder(run_dir, run_id).rank_pids(2))
                for agent in (marked | {parent_of(pid) for pid in marked}) - ranks - {os.getpid()}:
                    ports |= listening_ports_of(agent)  # its stores: the rendezvous's, the one its workers share

            time.sleep(0.1)
        assert ports, "the run's stores were not found"
        attack = as_user(other_user, [sys.executable, str(attacker), str(proof), *map(str, ports)])
        attack_output = attack.communicate(timeout=90)[0]
        # The agent reads the state again at its next heartbeat (every 5 s, keep_alive_interval in
        # dynamic_rendezvous.py): then the pickle runs, or the refusal is logged.
        log, refusal = RunFolder(run_dir).torchrun_log, "does not carry this job's signature"
        deadline = time.monotonic() + 60
        while not (proof.exists() or refusal in log.read_text(errors="replace")) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        release.touch()
        launch.join(120)
    assert "wrote torch.rendezvous." in attack_output, f"the attack never reached the store: {attack_output}"
    assert not proof.exists(), f"the other user's pickle ran as the learner: {proof.read_text()}"
    assert refusal in log.read_text(errors="replace"), log.read_text(errors="replace")[-3000:]


ATTACK_PORTS = textwrap.dedent(
    '''
    import base64, os, pickle, sys
    from datetime import timedelta
    import torch.distributed as dist

    class Payload:
        def __reduce__(self):
            return (os.system, (f"id > {sys.argv[1]}",))

    for attempt in range(5):  # a port that does not answer in time under load is tried again
        for port in map(int, sys.argv[2:]):
            try:
                store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
                # the state itself (torch.rendezvous.<id>), not the keys the agents keep below it
                keys = [key for key in store.list_keys() if key.startswith("torch.rendezvous.") and "/" not in key]
            except Exception as error:
                print("port", port, "no store:", type(error).__name__, flush=True)
                continue
            for key in keys:
                store.set(key, base64.b64encode(pickle.dumps(Payload())).decode())
                print("wrote", key, flush=True)
                sys.exit(0)
    '''
)


@needs_root
def test_another_users_process_named_as_the_runs_does_not_stop_its_end(other_user, write_script, tmp_path):
    """A warm rank is found at the run's end by its process name, which every user can read in /proc and
    anyone can give their own process: a stranger's namesake is neither swept (it is not ours to kill) nor
    allowed to cut the sweep short; the run ends as it would alone."""
    import threading
    import time

    from ddp_helpers.processes import process_name_for
    from ddp_helpers.run_folder import MARKER_NAME, read_json
    from support import failure_report, run_on_cpu

    run_dir, release, result = tmp_path / "run", tmp_path / "release", {}
    launch = threading.Thread(target=lambda: result.update(run=run_on_cpu(
        write_script("waits", WAITS_IN_A_GROUP), run_dir=run_dir, timeout_s=120, extra_env={"RELEASE": str(release)})))
    launch.start()
    namesake = None
    try:
        deadline, run_id = time.monotonic() + 60, None
        while not run_id and time.monotonic() < deadline and launch.is_alive():
            output = run_dir / "rank0.stdout"
            if output.exists() and "in the group" in output.read_text():
                run_id = (read_json(run_dir / MARKER_NAME) or {}).get("run_id")
            time.sleep(0.1)
        assert run_id, "the run never started"
        namesake = as_user(other_user, [sys.executable, "-c",
                                        "import ctypes, sys, time; ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0); "
                                        "print('named', flush=True); time.sleep(120)", process_name_for(run_id)])
        assert namesake.stdout.readline().strip() == "named"
    finally:
        release.touch()
        launch.join(120)
        try:
            alive_after_the_run = namesake is not None and namesake.poll() is None
        finally:
            if namesake is not None:
                namesake.kill()
                namesake.wait()
    run = result.get("run")
    assert run is not None and run.ok, failure_report(run) if run else "the launch raised"
    assert alive_after_the_run, "the other user's process was killed"


# A package named as ours, planted in a folder others can write: it leaves a file behind if it is ever imported.
PLANTED = "open({proof!r} + '/' + str(__import__('os').getpid()), 'w').close()\n"


def plant_our_package(folder: Path, proof: Path, user: pwd.struct_passwd | None) -> None:
    """`folder`/ddp_helpers/ with an __init__ that writes into `proof` when imported, written by `user` (the
    second user, when the tests run as root) into a folder anyone may write, as a shared scratch folder is."""
    folder.mkdir(mode=0o777, exist_ok=True)
    folder.chmod(0o1777)
    proof.mkdir(mode=0o777, exist_ok=True)
    proof.chmod(0o777)
    plant = (f"import os; os.makedirs({str(folder / 'ddp_helpers')!r}); "
             f"open({str(folder / 'ddp_helpers' / '__init__.py')!r}, 'w').write({PLANTED.format(proof=str(proof))!r})")
    if user is None:
        subprocess.run([sys.executable, "-c", plant], check=True)
    else:
        done = as_user(user, ["/usr/bin/env", "python3", "-c", plant])
        assert done.wait(timeout=30) == 0, done.stdout.read()


@pytest.fixture
def planted_folder(shared_folder, request):
    """A working folder others can write, holding a `ddp_helpers` package the second user planted there (this
    user, when the tests do not run as root); and the folder its proofs go to."""
    user = request.getfixturevalue("other_user") if os.geteuid() == 0 else None
    plant_our_package(shared_folder / "scratch", shared_folder / "proof", user)
    return shared_folder / "scratch", shared_folder / "proof"


@pytest.mark.parametrize("how", ["warm", "cold"])
def test_a_package_planted_in_a_working_folder_others_can_write_never_runs(how, planted_folder, write_script):
    """Every process of a launch (the supervisor, torchrun's agents, the ranks) starts with no working folder on its
    sys.path, so a `ddp_helpers` planted in the --cwd cannot stand in for ours."""
    from support import failure_report, run_on_cpu

    scratch, proof = planted_folder
    run = run_on_cpu(write_script("plain", "import os\nprint('rank', os.environ['RANK'])\n"), cwd=scratch,
                     cold=how == "cold")
    assert run.ok, failure_report(run)
    assert list(proof.iterdir()) == [], f"the planted package ran in {len(list(proof.iterdir()))} process(es)"


def test_a_warm_ranks_cold_fallback_does_not_import_from_its_working_folder(planted_folder, write_script):
    """The stub a warm launch starts for each rank becomes the rank itself when the warm process cannot take it
    (gone, refusing, stopped): that cold rank starts as safely as the others."""
    from ddp_helpers.engines import BOOTSTRAP
    from ddp_helpers.engines.local.engine import _STUB
    from ddp_helpers.python_command import python_module

    scratch, proof = planted_folder
    script = write_script("plain", "print('the script ran')\n")
    done = subprocess.run([sys.executable, "-S", "-u", _STUB, str(scratch / "no-such.sock"),
                           *python_module(BOOTSTRAP), str(script)],
                          cwd=scratch, capture_output=True, text=True, timeout=60)
    assert "the script ran" in done.stdout, done.stdout + done.stderr
    assert list(proof.iterdir()) == [], done.stdout + done.stderr


@pytest.mark.parametrize("safe_path_flag", [True, False])
def test_both_ways_of_starting_our_modules_leave_the_working_folder_off_sys_path(safe_path_flag, planted_folder):
    """-P on Python 3.11 and later; on 3.10, -c code that drops the working folder before importing anything."""
    from ddp_helpers.python_command import python_module

    scratch, proof = planted_folder
    done = subprocess.run([sys.executable, *python_module("ddp_helpers.rendezvous_port", safe_path_flag=safe_path_flag)],
                          cwd=scratch, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip().isdigit(), done.stdout + done.stderr
    assert list(proof.iterdir()) == []


HOSTS_A_STORE = textwrap.dedent(
    '''
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    print("hosting", flush=True)
    time.sleep(120)
    '''
)


@needs_root
@pytest.mark.parametrize("guard", ["loopback", "signed-only"])
def test_an_agent_never_joins_a_rendezvous_store_another_user_bound_first(guard, other_user, shared_folder, tmp_path):
    """Another user reads the port on the agents' command lines and binds it before they do. torch would make each
    agent a client of that store; the guarded agents fail loudly instead, and nothing of the job runs."""
    import uuid

    from ddp_helpers.rendezvous_port import rendezvous_port

    python, env = python_for_others()
    squatter = shared_folder / "squatter.py"
    squatter.write_text(HOSTS_A_STORE)
    squatter.chmod(0o644)
    port = rendezvous_port()
    hosting = as_user(other_user, [python, str(squatter), str(port)], extra_env=env)
    try:
        assert hosting.stdout.readline().strip() == "hosting"
        worker = tmp_path / "worker.py"
        worker.write_text("print('the job ran', flush=True)\n")
        # (--log-dir given here keeps --signed-only first, where guarded_torchrun looks for it)
        agent = [*(["--signed-only"] if guard == "signed-only" else []), "--log-dir", str(tmp_path / "logs"),
                 "--nnodes", "2", "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", uuid.uuid4().hex,
                 "--rdzv-conf", "join_timeout=20", str(worker)]
        results = run_torchrun_commands([agent, agent], timeout_s=60)
    finally:
        hosting.kill()
        hosting.wait()
    for code, output in results:
        assert code not in (0, None), output
        assert "held by another user's process" in output and "the job ran" not in output, output


LEAVES_UNMARKED_CHILDREN = textwrap.dedent(
    '''
    import os, subprocess
    from ddp_helpers import record
    if os.environ["RANK"] == "0":
        # A child in a process group of its own, with an empty environment: no marker, not in the rank's group.
        grouped = subprocess.Popen(["/bin/sleep", "300"], process_group=0, env={})
        # A grandchild orphaned at once, in a session of its own, empty environment too.
        shell = subprocess.run(["/bin/sh", "-c", "/usr/bin/setsid /bin/sleep 301 >/dev/null 2>&1 & echo $!"],
                               env={}, start_new_session=True, capture_output=True, text=True)
        record("left", [grouped.pid, int(shell.stdout)])
    '''
)


@pytest.mark.parametrize("how", ["warm", "cold"])
def test_a_child_with_its_own_group_and_no_environment_does_not_survive_the_run(how, write_script):
    from ddp_helpers.processes import process_is_dead
    from support import failure_report, run_on_cpu

    run = run_on_cpu(write_script("leaves", LEAVES_UNMARKED_CHILDREN), cold=how == "cold")
    assert run.ok, failure_report(run)
    survivors = [pid for pid in run.ranks[0].facts["left"] if not process_is_dead(pid)]
    for pid in survivors:
        os.kill(pid, 9)
    assert survivors == [], f"{survivors} of a {how} rank's children outlived the run"
