"""A broken environment, as users meet it: `gpu-tasks example run` / `serve` / `devices` and a flow script
on the runner, each run as a user would (a subprocess, its own PREFECT_HOME), fail fast.

Each case: exit code 2 (a flow script: 1), one line naming the cause and the fix, no traceback
(a flow script: Python's, ending in that line), under 10 s, and no process left behind (none
in the command's session, none with the test's PREFECT_HOME in its environment or command line).
"""

from __future__ import annotations

import contextlib
import http.server
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from faults import _procs

BIN = Path(sys.executable).parent
GPU_TASKS = str(BIN / "gpu-tasks")
# A hang guard, not a speed claim (tests assert no wall-clock speed): the faults these tests pin took
# 100-150 s and many lines before (Prefect's retries to a dead API, a temporary server's start); the
# one-line, no-traceback checks below are what tell them apart. On the quiet machine each answer
# comes in 2-5 s; under the CI's load, 10-13 s.
LIMIT_S = 60.0
IS_ROOT = os.geteuid() == 0
UNKNOWN_REVISION = "ffffffffffff"

FLOW_SCRIPT = textwrap.dedent(
    """
    from prefect import flow, task
    from gpu_tasks import ProfileTaskRunner, ResourceProfile

    @task
    def one() -> int:
        return 1

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="cpu", cpus=1)]))
    def pipeline() -> int:
        return one.submit().result()

    if __name__ == "__main__":
        print(pipeline())
    """
)


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    seconds: float

    @property
    def lines(self) -> list[str]:
        return [line for line in (self.out + self.err).splitlines() if line.strip()]


def _survivors(pid: int, marker: str) -> list[str]:
    """Processes of the command's session, or with ``marker`` (the test's PREFECT_HOME) in their
    environment or command line."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid == os.getpid():
            continue
        try:
            cmdline = " ".join(proc.info["cmdline"] or ())
            mine = os.getsid(proc.pid) == pid or marker in cmdline
            if not mine:
                mine = any(marker in str(v) for v in proc.environ().values())
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
        if mine:
            found.append(f"{proc.pid}: {cmdline[:160]}")
    return found


def _run(args: list[str], env: dict[str, str], cwd: Path, prefix: list[str] | None = None) -> Outcome:
    """Run ``args`` in a session of its own; its output and time; fail if it leaves a process."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [*(prefix or []), *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{args} still running after 60 s:\n{(out + err)[-3000:]}")
    seconds = time.monotonic() - t0
    left: list[str] = []
    for _ in range(10):  # a second for anything that is already on its way out
        left = _survivors(proc.pid, env["PREFECT_HOME"])
        if not left:
            break
        time.sleep(0.1)
    assert not left, f"processes left by {args}: {left}"
    return Outcome(proc.returncode, out, err, seconds)


def _one_line_error(result: Outcome, command: str, *needles: str) -> str:
    """Exit 2, one line ``error: gpu-tasks example <command>: ...`` with every needle, no traceback,
    fast."""
    text = result.out + result.err
    assert "Traceback" not in text, text[-3000:]
    assert result.code == 2, text[-3000:]
    assert len(result.lines) == 1, text[-3000:]
    line = result.lines[0]
    assert line.startswith(f"error: gpu-tasks example {command}: "), line
    for needle in needles:
        assert needle in line, (needle, line)
    assert result.seconds < LIMIT_S, f"{result.seconds:.1f} s: {line}"
    print(f"gpu-tasks example {command}: {result.seconds:.2f} s to: {line}")
    return line


def _flow_script_error(result: Outcome, *needles: str) -> str:
    """A flow script on the runner: exits non-zero within the limit, its last line the runner's
    one-line EnvironmentProblem with every needle."""
    text = result.out + result.err
    assert result.code != 0, text[-3000:]
    last = result.lines[-1]
    assert last.startswith("gpu_tasks.errors.EnvironmentProblem: "), text[-3000:]
    for needle in needles:
        assert needle in last, (needle, last)
    assert result.seconds < LIMIT_S, f"{result.seconds:.1f} s: {last}"
    assert "Timed out" not in text and "alembic" not in text.lower(), text[-3000:]
    print(f"flow script: {result.seconds:.2f} s to: {last}")
    return last


@pytest.fixture
def user_env(tmp_path) -> dict[str, str]:
    """A user's environment: a PREFECT_HOME of this test's own, no PREFECT_API_URL, no
    GPU_TASKS_* settings but a lease directory of its own, no colour."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "GPU_TASKS_"))}
    home = tmp_path / "prefect-home"
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        GPU_TASKS_LEASE_DIR=str(tmp_path / "leases"),
        GPU_TASKS_PRESENCE_DIR=str(tmp_path / "presence"),
        GPU_TASKS_DATA_DIR=str(tmp_path / "data"),
        NO_COLOR="1",
    )
    return env


@pytest.fixture(scope="module")
def migrated_db() -> Path:
    """A Prefect database as `prefect server database upgrade -y` leaves it (made once per host)."""
    return _procs.migrated_db()


def _newer_prefects_db(migrated_db: Path, home: Path) -> Path:
    """``home/prefect.db`` as a newer Prefect leaves it: a schema revision this one lacks."""
    home.mkdir(parents=True, exist_ok=True)
    db = home / "prefect.db"
    shutil.copy(migrated_db, db)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("UPDATE alembic_version SET version_num = ?", (UNKNOWN_REVISION,))
        conn.commit()
    return db


# --------------------------------------------------- a database of an unknown schema
def test_run_on_a_database_a_newer_prefect_migrated(tmp_path, user_env, migrated_db):
    db = _newer_prefects_db(migrated_db, Path(user_env["PREFECT_HOME"]))
    result = _run([GPU_TASKS, "example", "run", "--limit", "1000", "--emulate", "2"], user_env, tmp_path)
    _one_line_error(
        result, "run", str(db), repr(UNKNOWN_REVISION), "prefect server database reset -y", "PREFECT_HOME"
    )


def test_devices_lists_devices_and_warns_in_one_line(tmp_path, user_env, migrated_db):
    """`devices` opens no database and asks no server: it lists the devices (exit 0) after one
    warning line naming the problem and the fix."""
    db = _newer_prefects_db(migrated_db, Path(user_env["PREFECT_HOME"]))
    user_env["GPU_TASKS_EMULATED_GPUS"] = "2"
    result = _run([GPU_TASKS, "devices"], user_env, tmp_path)
    assert result.code == 0, result.out + result.err
    warning = [line for line in result.err.splitlines() if line.strip()]
    assert len(warning) == 1 and warning[0].startswith("warning: a flow run here would stop"), result.err
    assert str(db) in warning[0] and "prefect server database reset -y" in warning[0]
    assert "EMULATED" in result.out and "Traceback" not in result.out + result.err
    assert result.seconds < LIMIT_S
    print(f"gpu-tasks devices: {result.seconds:.2f} s, warning: {warning[0][:100]}...")


@pytest.mark.slow
def test_the_advised_reset_clears_the_problem(tmp_path, user_env, migrated_db):
    """`prefect server database reset -y`, as the line advises, makes the database one this
    Prefect opens (tens of seconds on 2 busy cores: it drops and re-creates every table)."""
    _newer_prefects_db(migrated_db, Path(user_env["PREFECT_HOME"]))
    reset = _run([str(BIN / "prefect"), "server", "database", "reset", "-y"], user_env, tmp_path)
    assert reset.code == 0, reset.out + reset.err
    after = _run([GPU_TASKS, "devices"], user_env, tmp_path)
    assert after.code == 0 and after.err.strip() == "", after.err


def test_flow_script_on_the_runner_on_a_database_a_newer_prefect_migrated(tmp_path, user_env, migrated_db):
    """Before: Prefect's ephemeral server retried for about two minutes, a traceback each time.
    Prefect starts that server before it enters the task runner, so the runner checks when it
    is built (once per process)."""
    db = _newer_prefects_db(migrated_db, Path(user_env["PREFECT_HOME"]))
    script = tmp_path / "flow.py"
    script.write_text(FLOW_SCRIPT)
    result = _run([sys.executable, str(script)], user_env, tmp_path)
    _flow_script_error(result, str(db), repr(UNKNOWN_REVISION), "prefect server database reset -y")


# --------------------------------------------------- a PREFECT_HOME that cannot be written
@pytest.mark.parametrize("command", ["run", "serve"])
def test_prefect_home_under_a_regular_file(tmp_path, user_env, command):
    """A PREFECT_HOME Prefect cannot create (one of its parents is a file): Prefect's own
    warning is left out; the command's line names the file."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    user_env["PREFECT_HOME"] = str(blocker / "prefect")
    if command == "serve":  # serve needs a server; its home is checked before the server is asked
        user_env["PREFECT_API_URL"] = "http://127.0.0.1:9/api"
    result = _run([GPU_TASKS, "example", command, "--limit", "1000", "--emulate", "2"], user_env, tmp_path)
    _one_line_error(
        result, command, f"PREFECT_HOME {blocker / 'prefect'}", f"{blocker} is a file", "set PREFECT_HOME"
    )


def _not_writable_home(home: Path) -> list[str]:
    """Make ``home`` (holding a database) a directory this user cannot write, as a ~/.prefect
    created by `sudo prefect ...` is to its user; the prefix to run a command as such a user.

    As root, permission bits do not stop writes, and this box's interpreter lives under a 0700
    /root a throwaway user cannot enter; so the command runs as root without the capabilities
    that bypass file permissions (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), against a home owned
    by another user (nobody): the kernel refuses the write as it does for any other user.
    """
    if not IS_ROOT:
        home.chmod(0o555)
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv (util-linux): cannot drop CAP_DAC_OVERRIDE")
    for path in (home, *home.iterdir()):
        os.chown(path, 65534, 65534)
    home.chmod(0o755)
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", "--bounding-set", caps, "--inh-caps", caps, "--"]


def test_prefect_home_owned_by_another_user(tmp_path, user_env, migrated_db):
    home = Path(user_env["PREFECT_HOME"])
    home.mkdir()
    shutil.copy(migrated_db, home / "prefect.db")
    prefix = _not_writable_home(home)
    try:
        result = _run(
            [GPU_TASKS, "example", "run", "--limit", "1000", "--emulate", "2"], user_env, tmp_path, prefix
        )
        _one_line_error(result, "run", f"PREFECT_HOME {home} is not writable (Permission denied)")
        script = tmp_path / "flow.py"
        script.write_text(FLOW_SCRIPT)
        flow = _run([sys.executable, str(script)], user_env, tmp_path, prefix)
        _flow_script_error(flow, f"PREFECT_HOME {home} is not writable", "set PREFECT_HOME")
    finally:
        home.chmod(0o755)


@contextlib.contextmanager
def _tmpfs(where: Path, size: str = "1m", read_only: bool = False) -> Iterator[Path]:
    """A tiny tmpfs mounted at ``where`` (root only), unmounted afterwards."""
    if not IS_ROOT:
        pytest.skip("mounting a tiny tmpfs (a full or read-only disk) needs root")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        if read_only:
            subprocess.run(["mount", "-o", "remount,rw", str(where)], check=False)
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_prefect_home_on_a_read_only_disk(tmp_path, user_env, migrated_db):
    """A read-only root filesystem (a container with readOnlyRootFilesystem): root cannot write."""
    with _tmpfs(tmp_path / "ro", size="4m", read_only=True) as mount:
        home = mount / "prefect"
        home.mkdir()
        shutil.copy(migrated_db, home / "prefect.db")
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        user_env["PREFECT_HOME"] = str(home)
        result = _run([GPU_TASKS, "example", "run", "--limit", "1000", "--emulate", "2"], user_env, tmp_path)
        _one_line_error(result, "run", f"PREFECT_HOME {home} is not writable (Read-only file system)")


# --------------------------------------------------- a full disk where results go
def _fill(mount: Path) -> None:
    with open(mount / "filler", "wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()


@pytest.mark.parametrize("command", ["run", "serve"])
def test_full_disk_under_the_data_directory(tmp_path, user_env, command):
    with _tmpfs(tmp_path / "full") as mount:
        _fill(mount)
        user_env["GPU_TASKS_DATA_DIR"] = str(mount / "data")
        if command == "serve":
            user_env["PREFECT_API_URL"] = "http://127.0.0.1:9/api"  # disk first: nothing is asked
        result = _run(
            [GPU_TASKS, "example", command, "--limit", "1000", "--emulate", "2"], user_env, tmp_path
        )
        _one_line_error(
            result,
            command,
            f"data directory {mount / 'data'}",
            f"free space on {mount}",
            "GPU_TASKS_DATA_DIR",
        )


def test_full_disk_under_prefect_home(tmp_path, user_env):
    with _tmpfs(tmp_path / "full") as mount:
        home = mount / "prefect"
        home.mkdir()
        _fill(mount)
        user_env["PREFECT_HOME"] = str(home)
        result = _run([GPU_TASKS, "example", "run", "--limit", "1000", "--emulate", "2"], user_env, tmp_path)
        _one_line_error(result, "run", f"Prefect's database {home}", f"free space on {home}", "PREFECT_HOME")
        script = tmp_path / "flow.py"
        script.write_text(FLOW_SCRIPT)
        flow = _run([sys.executable, str(script)], user_env, tmp_path)
        _flow_script_error(flow, f"Prefect's database {home}", "free space")


# --------------------------------------------------- PREFECT_API_URL: nothing there, a port taken
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("command", ["run", "serve"])
def test_api_url_pointing_at_nothing(tmp_path, user_env, command):
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    user_env["PREFECT_API_URL"] = url
    result = _run([GPU_TASKS, "example", command, "--limit", "1000", "--emulate", "2"], user_env, tmp_path)
    line = _one_line_error(
        result,
        command,
        f"nothing answers at PREFECT_API_URL {url}",
        f"prefect server start --host 127.0.0.1 --port {port}",
    )
    assert ("unset PREFECT_API_URL" in line) == (command == "run")  # serve needs a server of yours


@pytest.mark.parametrize("command", ["run", "serve"])
def test_api_port_taken_by_something_that_does_not_answer(tmp_path, user_env, command):
    """No gpu-tasks command takes a port: `run` picks a free one for its own server and `serve`
    uses PREFECT_API_URL's. A port the user can name is PREFECT_API_URL's; here something else
    (this test) listens there and never answers."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        url = f"http://127.0.0.1:{port}/api"
        user_env["PREFECT_API_URL"] = url
        result = _run(
            [GPU_TASKS, "example", command, "--limit", "1000", "--emulate", "2"], user_env, tmp_path
        )
    _one_line_error(
        result,
        command,
        f"PREFECT_API_URL {url} does not answer within 2 s",
        f"port {port} is held by",
        f"pid {os.getpid()}",
        "free port",
    )


def test_api_port_answered_by_something_that_is_not_prefect(tmp_path, user_env):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/api"
        user_env["PREFECT_API_URL"] = url
        result = _run(
            [GPU_TASKS, "example", "serve", "--limit", "1000", "--emulate", "2"], user_env, tmp_path
        )
    finally:
        server.shutdown()
        server.server_close()
    _one_line_error(
        result,
        "serve",
        f"PREFECT_API_URL {url} is answered by something that is not a Prefect API",
        "HTTP 404",
    )


def test_the_suite_collects_on_a_prefect_home_a_newer_prefect_migrated(tmp_path, user_env, migrated_db):
    """No test module does I/O at import (a runner built at module level checks Prefect's home): the
    suite collects on a user's ~/.prefect that a newer Prefect migrated, as `pytest` run by hand
    would meet it."""
    home = tmp_path / "prefect-home"
    _newer_prefects_db(migrated_db, home)
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "tests"],
        env=user_env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "EnvironmentProblem" not in result.stdout + result.stderr
    assert (home / "prefect.db").exists()  # the test kept the home it was given
