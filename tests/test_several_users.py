"""Several Unix users on one host: two real users lease emulated devices (docs/shared-hosts.md).

The test process (root) makes a group and two users (``gtu-``, its pid and a random suffix;
leftovers of that prefix whose test process has ended are removed first, and everything is removed
at the end) and runs small programs as each user with ``setpriv``. It proves, in a shared lease
directory made by ``gpu-tasks leases setup``, that user B never leases the device user A holds,
gets it once A lets go (or is SIGKILLed), and can neither delete, rename, rewrite nor replace A's
files; and, with the per-user default, that B's run leaves A's device alone, says whose it is, and
``gpu-tasks devices`` shows it.

The users need an interpreter they may run: this one, or (when it lies under a directory they
cannot enter, as /root/.pyenv under /root 0700 does) a system ``python3.X`` of the same version
with this environment's site-packages on ``PYTHONPATH``. Skipped, with the reason, when not root,
without ``useradd``/``setpriv``, or when neither interpreter can import gpu-tasks as another user.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import gpu_tasks
from gpu_tasks.cli import app
from gpu_tasks.devices import lease_files, leases

CODE = Path(gpu_tasks.__file__).resolve().parent.parent  # the code under test
PREFIX = "gtu-"

HOLD = textwrap.dedent(
    """
    import json, logging, os, sys, time
    from pathlib import Path
    from gpu_tasks.devices.book import DeviceBook
    from gpu_tasks.devices.discovery import Device

    cfg = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    devices = {a: Device(address=a, index=int(a), name="EMU") for a in ("0", "1")}
    book = DeviceBook(lease_dir=cfg.get("lease_dir"), lease_timeout=30, log_every=0.2)
    out = {"pid": os.getpid(), "uid": os.getuid()}
    if cfg.get("probe"):  # any free device of the two, without waiting
        got = book.acquire("probe", [(devices["0"],), (devices["1"],)], 1, block=False)
        out["probe"] = [["0", "1"][i] for i in got]
        book.release("probe", out["probe"])
    out["asked"] = time.time()
    book.acquire(cfg["profile"], [(devices[cfg["device"]],)], 1, block=True)
    out["start"] = time.time()
    Path(cfg["ready"]).write_text(json.dumps(out))
    deadline = time.monotonic() + cfg.get("hold", 20)
    while not Path(cfg["release"]).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    out["end"] = time.time()  # held until at least now
    book.release(cfg["profile"], [cfg["device"]])
    print(json.dumps(out))
    """
)

ATTACK = textwrap.dedent(
    """
    import errno, fcntl, json, os, sys
    from pathlib import Path

    shared, victim_uid = Path(sys.argv[1]), int(sys.argv[2])
    lock, info = shared / "device-0.lock", shared / f"holder-0.{victim_uid}.json"
    mine = shared / f"mine-{os.getpid()}"
    mine.write_text("{}")

    def attempt(fn):
        try:
            fn()
        except OSError as exc:
            return errno.errorcode[exc.errno]
        return "done"

    def steal():
        fd = os.open(lock, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    out = {}
    for name, path in (("lock", lock), ("info", info)):
        out[name] = {
            "unlink": attempt(lambda: os.unlink(path)),
            "rename": attempt(lambda: os.rename(path, shared / "moved")),
            "rewrite": attempt(lambda: os.open(path, os.O_WRONLY)),
            "chmod": attempt(lambda: os.chmod(path, 0o666)),
            "replace": attempt(lambda: os.rename(mine, path)),
        }
    out["lock"]["steal"] = attempt(steal)
    os.unlink(mine)
    os.symlink(shared / "device-0.lock", shared / "device-7.lock")  # planted for the next user of device 7
    # a waiter that dies without leaving the queue: its file stays, and nobody else may delete it
    from gpu_tasks.devices import leases
    waiter = leases.enqueue(["1"], leases.owner_info("dead"), lease_dir=shared)
    out["waiter"] = waiter.name
    # a lock file of another user's own (per-user) directory: named, with its owner, mode and the fix
    try:
        leases.take(["0"], leases.owner_info("b"), sys.argv[3])
    except OSError as exc:
        out["foreign_lock"] = str(exc)
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)
    """
)


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False, env=env)


def _left_over(suffix: str) -> bool:
    """Whether the test process that made the users or area of this suffix (``<pid>x<hex>``) has
    ended: another test process's users, made by this module's other half under pytest-xdist's
    worksteal, are still in use."""
    pid = suffix.partition("x")[0]
    if not pid.isdigit():
        return True  # an older layout, from before the creator's pid was in the name
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    return False


def _remove_leftovers() -> None:
    for db, remove in (("passwd", "userdel"), ("group", "groupdel")):
        for line in _run(["getent", db]).stdout.splitlines():
            name = line.split(":", 1)[0]
            if name.startswith(PREFIX) and _left_over(name[len(PREFIX) + 1 :]):
                _run([remove, name])
    for path in Path("/tmp").glob(f"{PREFIX}*"):
        if not _left_over(path.name[len(PREFIX) :]):
            continue
        if path.is_dir() and not path.is_symlink() and path.stat().st_uid == 0:
            shutil.rmtree(path, ignore_errors=True)


class Host:
    """Two users of one group, an area they can reach, and how to run Python as them."""

    def __init__(self, suffix: str) -> None:
        self.group, self.a, self.b = f"{PREFIX}g{suffix}", f"{PREFIX}a{suffix}", f"{PREFIX}b{suffix}"
        self.area = Path(f"/tmp/{PREFIX}{suffix}")
        self.procs: list[subprocess.Popen[str]] = []
        self.python, self.path = sys.executable, str(CODE)

    def uid(self, user: str) -> int:
        import pwd

        return pwd.getpwnam(user).pw_uid

    def env(self, user: str, **extra: str) -> dict[str, str]:
        home = self.area / f"home-{user}"
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "PYTHONPATH": self.path,
            "HOME": str(home),
            "PREFECT_HOME": str(home / ".prefect"),
            "TMPDIR": str(self.area / "tmp"),  # the per-user default lease dirs are here
            # the host-wide one's default, /tmp/gpu-tasks-presence, in this test's own area
            "GPU_TASKS_PRESENCE_DIR": str(self.area / "tmp" / "gpu-tasks-presence"),
            "GPU_TASKS_EMULATED_GPUS": "2",
            "NO_COLOR": "1",
            "COLUMNS": "250",
            "LANG": "C.UTF-8",
            **extra,
        }

    def command(self, user: str, *args: str) -> list[str]:
        return ["setpriv", f"--reuid={self.uid(user)}", f"--regid={self.group}", "--init-groups", "--", *args]

    def python_as(self, user: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            self.command(user, self.python, *args),
            env=env or self.env(user),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def hold(self, user: str, name: str, device: str, env: dict[str, str], **cfg: object) -> tuple:
        """``user`` leases ``device`` (profile ``name``) and holds it until :meth:`let_go`."""
        files = {k: self.area / "out" / f"{name}.{k}" for k in ("ready", "release", "log")}
        for f in files.values():
            f.unlink(missing_ok=True)
        config = dict(
            cfg, profile=name, device=device, ready=str(files["ready"]), release=str(files["release"])
        )
        log = open(files["log"], "w")  # the child writes it while the test reads it
        proc = subprocess.Popen(
            self.command(user, self.python, str(self.area / "hold.py"), json.dumps(config)),
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        log.close()
        self.procs.append(proc)
        return proc, files

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def _until(check, what: str, proc: subprocess.Popen[str] | None = None, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the program ended early: {proc.communicate()}")
        assert time.monotonic() < deadline, f"{what}: not within {seconds}s"
        time.sleep(0.05)


def _waits(files: dict[str, Path], proc: subprocess.Popen[str]) -> None:
    """Until the program says it waits for a device another process leases."""
    _until(
        lambda: "waiting for devices leased by other flow runs" in files["log"].read_text(), "B waits", proc
    )


def _finish(proc: subprocess.Popen[str], files: dict[str, Path]) -> dict:
    out, _ = proc.communicate(timeout=30)
    log = files["log"].read_text()
    assert proc.returncode == 0, log
    return dict(json.loads(out), log=log)


def _try_interpreters(host: Host) -> str | None:
    """Pick an interpreter user A can run gpu-tasks with; the reason when there is none."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = sysconfig.get_paths()["purelib"]
    tries = [(sys.executable, str(CODE))]
    system = shutil.which(version, path="/usr/local/bin:/usr/bin:/bin")
    if system:
        tries.append((system, f"{CODE}:{site}"))
    why = []
    for python, path in tries:
        host.python, host.path = python, path
        proc = host.python_as(host.a, "-c", "import gpu_tasks.devices.book, gpu_tasks.cli")
        _, err = proc.communicate(timeout=60)
        if proc.returncode == 0:
            return None
        why.append(f"{python}: {(err.strip().splitlines() or ['?'])[-1]}")
    return "no interpreter with gpu-tasks that another user may run: " + "; ".join(why)


@pytest.fixture(scope="module")
def host():
    if os.geteuid() != 0:
        pytest.skip("needs root: it creates two Unix users")
    missing = [c for c in ("useradd", "userdel", "groupadd", "groupdel", "setpriv") if not shutil.which(c)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} to run programs as two Unix users")
    _remove_leftovers()
    suffix = f"{os.getpid()}x{secrets.token_hex(3)}"  # the creator, for _remove_leftovers
    h = Host(suffix)
    try:
        made = _run(["groupadd", h.group])
        assert made.returncode == 0, made.stderr
        for user in (h.a, h.b):
            made = _run(
                ["useradd", "--no-create-home", "--no-user-group", "-g", h.group, "-s", "/bin/sh", user]
            )
            assert made.returncode == 0, made.stderr
        h.area.mkdir(mode=0o755)
        os.chmod(h.area, 0o755)
        for sub, mode in (("tmp", 0o1777), ("out", 0o1777)):
            (h.area / sub).mkdir()
            os.chmod(h.area / sub, mode)
        for user in (h.a, h.b):
            home = h.area / f"home-{user}"
            home.mkdir(mode=0o700)
            os.chown(home, h.uid(user), -1)
        for name, text in (("hold.py", HOLD), ("attack.py", ATTACK)):
            (h.area / name).write_text(text)
            os.chmod(h.area / name, 0o644)
        # the admin's set-up, as documented: a shared directory and a root-owned presence directory
        # (started first: it runs while the users' interpreter is tried)
        setup = subprocess.Popen(
            [sys.executable, "-m", "gpu_tasks.cli", "leases", "setup", f"{h.area}/shared", "-g", h.group],
            env=dict(os.environ, GPU_TASKS_EMULATED_GPUS="2", GPU_TASKS_PRESENCE_DIR=f"{h.area}/presence"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        h.procs.append(setup)
        reason = _try_interpreters(h)
        _, err = setup.communicate(timeout=60)
        assert setup.returncode == 0, err
        if reason:
            pytest.skip(reason)
        yield h
    finally:
        h.stop_all()
        for user in (h.a, h.b):
            _run(["userdel", user])
        _run(["groupdel", h.group])
        shutil.rmtree(h.area, ignore_errors=True)


def _shared_env(host: Host, user: str) -> dict[str, str]:
    return host.env(
        user,
        GPU_TASKS_LEASE_DIR=str(host.area / "shared"),
        GPU_TASKS_PRESENCE_DIR=str(host.area / "presence"),
    )


def test_setup_makes_a_shared_directory(host):
    shared = host.area / "shared"
    for path in (shared, shared / "queue"):
        st = path.stat()
        assert (st.st_uid, oct(st.st_mode & 0o7777)) == (0, "0o3770"), path
    for address in ("0", "1"):
        st = (shared / f"device-{address}.lock").stat()
        assert (st.st_uid, oct(st.st_mode & 0o7777)) == (0, "0o444")
    st = (host.area / "presence").stat()
    assert (st.st_uid, oct(st.st_mode & 0o7777)) == (0, "0o1777")


def test_a_user_outside_the_group_is_told_to_join_it(host):
    """docs/shared-hosts.md: a user outside the shared directory's group is told to join it (user A,
    run without the group, stands in for one; the message said to pick another lease directory)."""
    files = {k: host.area / "out" / f"outsider.{k}" for k in ("ready", "release")}
    cfg = dict(profile="outsider", device="0", ready=str(files["ready"]), release=str(files["release"]))
    out = subprocess.run(
        [
            *("setpriv", f"--reuid={host.uid(host.a)}", "--regid=65534", "--clear-groups", "--"),
            *(host.python, str(host.area / "hold.py"), json.dumps(cfg)),
        ],
        env=_shared_env(host, host.a),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and not files["ready"].exists(), out
    last = out.stderr.strip().splitlines()[-1]
    assert f"user {host.a} may not use lease directory" in last and "not in its group" in last, last
    assert f"sudo usermod -aG {host.group} {host.a}" in last, last

    # the CLI says so too: it showed every holder as "unknown" and no waiter, silently (a new-user pass)
    def cli(command: str) -> tuple[subprocess.CompletedProcess[str], str]:
        out = subprocess.run(
            [
                *("setpriv", f"--reuid={host.uid(host.a)}", "--regid=65534", "--clear-groups", "--"),
                *(host.python, "-m", "gpu_tasks.cli", command),
            ],
            env=_shared_env(host, host.a),
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out, " ".join(out.stderr.split())

    for command in ("devices", "waiters"):
        out, said = cli(command)
        assert out.returncode == 0 and "not in its group" in said and "sudo usermod -aG" in said, (
            command,
            out,
        )
    # a member of the group (/etc/group) whose session began before it joined: told to log in again
    if shutil.which("gpasswd"):
        assert _run(["gpasswd", "-a", host.a, host.group]).returncode == 0
        try:
            out, said = cli("devices")
        finally:
            _run(["gpasswd", "-d", host.a, host.group])
        assert f"user {host.a} is in group {host.group}, but this process is not" in said, out
        assert f"log in again, or run it under newgrp {host.group}" in said, out


def test_shared_directory_one_device_one_user_at_a_time(host, monkeypatch):
    a, files_a = host.hold(host.a, "a-run", "0", _shared_env(host, host.a))
    _until(files_a["ready"].exists, "user A leases device 0", a)
    b, files_b = host.hold(host.b, "b-run", "0", _shared_env(host, host.b))
    _waits(files_b, b)
    assert not files_b["ready"].exists(), "user B leased the device user A holds"
    monkeypatch.setenv("GPU_TASKS_PRESENCE_DIR", str(host.area / "presence"))
    info = leases.holders(host.area / "shared", ["0"])["0"]
    assert info["user"] == host.a and info["uid"] == host.uid(host.a) and info["pid"] == a.pid
    files_b["release"].touch()  # B lets go as soon as it has the device
    files_a["release"].touch()
    got_a, got_b = _finish(a, files_a), _finish(b, files_b)
    assert got_b["start"] >= got_a["end"], (got_a, got_b)
    assert f"pid {a.pid}, user {host.a}" in got_b["log"], got_b["log"]
    assert leases.holders(host.area / "shared", ["0", "1"]) == {"0": None, "1": None}


def test_no_user_can_delete_rewrite_or_replace_another_users_files(host, monkeypatch):
    shared = host.area / "shared"
    a, files_a = host.hold(host.a, "a-run", "0", _shared_env(host, host.a))
    try:
        _until(files_a["ready"].exists, "user A leases device 0", a)
        private = host.area / "out" / "a-private"  # user A's own lease directory, 0755, its lock file 0644
        private.mkdir(mode=0o755, exist_ok=True)
        (private / "device-0.lock").write_text("{}")
        for path, mode in ((private, 0o755), (private / "device-0.lock", 0o644)):
            shutil.chown(path, host.a, host.group)
            os.chmod(path, mode)
        attack = host.python_as(
            host.b, str(host.area / "attack.py"), str(shared), str(host.uid(host.a)), str(private)
        )
        out, err = attack.communicate(timeout=60)
        assert attack.returncode == 0, err
        tried = json.loads(out)
        refused = {"EPERM", "EACCES"}
        for name in ("lock", "info"):
            for how in ("unlink", "rename", "rewrite", "chmod", "replace"):
                assert tried[name][how] in refused, (name, how, tried)
        assert tried["lock"]["steal"] == errno.errorcode[errno.EWOULDBLOCK]
        named = f"device-0.lock' (owner {host.a}, group {host.group}, mode 0644): user {host.b} may not write"
        assert named in tried.get("foreign_lock", ""), tried
        assert "unset GPU_TASKS_LEASE_DIR" in tried["foreign_lock"]
        assert leases.holders(shared, ["0"])["0"]["pid"] == a.pid, "A still holds device 0, named as before"
    finally:
        files_a["release"].touch()
        _finish(a, files_a)
    # the symlink B planted as device 7's lock file is refused, naming it
    monkeypatch.setenv("GPU_TASKS_PRESENCE_DIR", str(host.area / "presence"))
    with pytest.raises(lease_files.LeaseFileError, match=r"device-7\.lock' is a symbolic link"):
        leases.take(["7"], leases.owner_info("victim"), shared)
    # B's waiter died without leaving the queue: A skips its file (it may not delete it), no error
    waiter = shared / "queue" / tried["waiter"]
    assert waiter.exists() and oct(waiter.stat().st_mode & 0o777) == "0o644"
    check = host.python_as(
        host.a, "-c", f"from gpu_tasks.devices import leases; print(len(leases.waiters({str(shared)!r})))"
    )
    out, err = check.communicate(timeout=60)
    assert (check.returncode, out.strip()) == (0, "0"), err
    assert waiter.exists(), "only its owner (or root) may delete it"


def test_per_user_default_leaves_another_users_device_alone(host, monkeypatch):
    env_a, env_b = host.env(host.a), host.env(host.b)  # GPU_TASKS_LEASE_DIR unset: per-user directories
    a, files_a = host.hold(host.a, "a-run", "0", env_a)
    _until(files_a["ready"].exists, "user A leases device 0", a)
    devices = host.python_as(host.b, "-m", "gpu_tasks.cli", "devices", "--json", env=env_b)
    b, files_b = host.hold(host.b, "b-run", "0", env_b, probe=True)
    _waits(files_b, b)
    out, err = devices.communicate(timeout=60)
    assert devices.returncode == 0, err
    held = {d["address"]: d["held_by"] for d in json.loads(out)["devices"]}
    assert held["0"]["user"] == host.a and held["0"]["pid"] == a.pid and held["0"]["elsewhere"] is True
    # the table, as any other user sees it (here root, in this process: one program less to start)
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "2")
    monkeypatch.setenv("GPU_TASKS_PRESENCE_DIR", str(host.area / "tmp" / "gpu-tasks-presence"))
    table = CliRunner().invoke(app, ["devices"], env={"COLUMNS": "250", "NO_COLOR": "1"}).stdout
    assert host.a in table and "flow runs of this user leave them alone" in table, table
    assert not files_b["ready"].exists(), "user B leased the device user A holds"
    files_b["release"].touch()  # B lets go as soon as it has the device
    files_a["release"].touch()
    got_a, got_b = _finish(a, files_a), _finish(b, files_b)
    assert got_b["probe"] == ["1"], "B took the free device, not A's"
    assert got_b["start"] >= got_a["end"], (got_a, got_b)
    log = got_b["log"]
    assert f"device 0 is leased by user {host.a}'s gpu-tasks flow run (pid {a.pid}" in log, log
    assert f"pid {a.pid}, user {host.a}, in a lease directory this user does not share" in log, log
    assert "docs/shared-hosts.md" in log


def test_sigkilled_holder_frees_the_device_for_the_other_user_at_once(host):
    a, files_a = host.hold(host.a, "a-run", "1", _shared_env(host, host.a))
    _until(files_a["ready"].exists, "user A leases device 1", a)
    b, files_b = host.hold(host.b, "b-run", "1", _shared_env(host, host.b))
    _waits(files_b, b)
    killed = time.time()
    os.kill(a.pid, signal.SIGKILL)
    _until(files_b["ready"].exists, "user B leases device 1 after A was killed", b, seconds=5)
    got_b = json.loads(files_b["ready"].read_text())
    files_b["release"].touch()
    _finish(b, files_b)
    assert got_b["start"] - killed < 2.0, got_b["start"] - killed


# ------------------------------------------------------------------ one user, no accounts needed
def test_a_shared_directory_without_the_sticky_bit_is_refused(tmp_path):
    from gpu_tasks import ClusterError
    from gpu_tasks.devices.book import DeviceBook
    from gpu_tasks.devices.discovery import Device

    shared = tmp_path / "leases"
    shared.mkdir()
    os.chmod(shared, 0o2770)
    with pytest.raises(
        lease_files.LeaseFileError, match=r"writable by other users but not sticky.*chmod \+t"
    ):
        leases.take(["0"], leases.owner_info("p"), shared)
    book = DeviceBook(lease_dir=shared, lease_timeout=0)
    with pytest.raises(ClusterError, match="gpu-tasks leases setup") as failed:
        book.acquire("p", [(Device(address="0", index=0, name="EMU"),)], 1, block=False)
    assert "a directory this user can write" not in str(failed.value), "one fix, the right one"
    # this environment's gpu-tasks by its full path: sudo's PATH has no virtual environment in it
    # (the message said `sudo gpu-tasks ...`: "command not found" there; a new-user pass)
    assert f"sudo {Path(sys.executable).with_name('gpu-tasks')} leases setup" in str(failed.value)


def test_a_sticky_world_writable_directory_gets_explicit_modes(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_TASKS_PRESENCE_DIR", str(tmp_path / "presence"))
    shared = tmp_path / "leases"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    umask = os.umask(0o077)  # the modes are gpu-tasks' own, not the umask's
    try:
        lease = leases.take(["0"], leases.owner_info("p"), shared)
        waiter = leases.enqueue(["1"], leases.owner_info("q"), lease_dir=shared)
    finally:
        os.umask(umask)
    try:
        mode = {
            p.name: oct(p.stat().st_mode & 0o7777) for p in (*shared.iterdir(), *(shared / "queue").iterdir())
        }
        assert mode == {
            "device-0.lock": "0o444",
            f"holder-0.{os.getuid()}.json": "0o644",
            "queue": "0o1777",
            waiter.name: "0o644",
        }
        assert leases.holders(shared)["0"]["pid"] == os.getpid()
        assert [w["profile"] for w in leases.waiters(shared)] == ["q"]
    finally:
        leases.dequeue(waiter)
        leases.release(lease)
    assert leases.holders(shared) == {"0": None}, "the holder-info file left behind is stale: unlocked"


def test_a_symlink_in_place_of_a_lock_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_TASKS_PRESENCE_DIR", str(tmp_path / "presence"))
    mine = tmp_path / "leases"
    mine.mkdir(mode=0o700)
    (mine / "device-0.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(lease_files.LeaseFileError, match=r"device-0\.lock' is a symbolic link"):
        leases.take(["0"], leases.owner_info("p"), mine)
    assert not (tmp_path / "elsewhere").exists()


def test_one_users_runs_in_two_lease_directories_stay_apart_as_before(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_TASKS_PRESENCE_DIR", str(tmp_path / "presence"))
    one = leases.take(["0"], leases.owner_info("a"), tmp_path / "one")
    two = leases.take(["0"], leases.owner_info("b"), tmp_path / "two")
    try:
        assert one is not None and two is not None
        assert len(list((tmp_path / "presence").iterdir())) == 2
    finally:
        leases.release(one)
        leases.release(two)
    assert list((tmp_path / "presence").iterdir()) == [], "presence files go with their leases"


def test_a_device_another_user_holds_elsewhere_is_not_leased(tmp_path, monkeypatch):
    """Another user's presence file, made here by root (chown) and locked by this process."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a file of another uid")
    import fcntl

    from gpu_tasks.devices import presence

    monkeypatch.setenv("GPU_TASKS_PRESENCE_DIR", str(tmp_path / "presence"))
    where = presence.directory()
    assert where is not None and oct(where.stat().st_mode & 0o7777) == "0o1777"
    other = 4242424  # no such user: named by its number
    theirs = where / f"device-0.{other}.{presence.key(tmp_path / 'theirs')}.lock"
    theirs.write_text(json.dumps({"pid": 4242, "profile": "train", "flow_run_name": "crimson-owl"}))
    os.chown(theirs, other, -1)
    fd = os.open(theirs, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert leases.take(["0"], leases.owner_info("p"), tmp_path / "mine") is None
        info = leases.holders(tmp_path / "mine", ["0"])["0"]
        assert (info["user"], info["uid"], info["elsewhere"], info["pid"]) == (str(other), other, True, 4242)
        assert "user 4242424, in a lease directory this user does not share" in leases.describe(info)
        lease = leases.take(["1"], leases.owner_info("p"), tmp_path / "mine")
        assert lease is not None, "another device is free"
        leases.release(lease)
    finally:
        os.close(fd)
    lease = leases.take(["0"], leases.owner_info("p"), tmp_path / "mine")
    assert lease is not None, "free once the other user's run let go"
    leases.release(lease)
