"""Programs outside gpu-tasks on a device (gpu_tasks.devices.programs, docs/shared-hosts.md).

The programs are real processes (``sleep``), started detached so that they are not descendants
of this test process (a flow run's own descendants are gpu-tasks' own, never "other programs").
Emulated devices declare what each uses (``GPU_TASKS_EMULATED_GPUS="H100:80GiB@PID:60GiB"``);
a declaration counts only while its process runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
from typer.testing import CliRunner

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile
from gpu_tasks.cli import app
from gpu_tasks.devices import leases, programs
from gpu_tasks.devices.book import DeviceBook
from gpu_tasks.devices.discovery import parse_emulated
from gpu_tasks.errors import DeviceDiscoveryError

GiB = 2**30
ME = pwd.getpwuid(os.getuid()).pw_name


def _outsider(seconds: int = 60) -> int:
    """Start ``sleep`` detached from this process (its parent shell exits at once); its pid."""
    out = subprocess.run(
        ["sh", "-c", f"sleep {seconds} >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
    )
    pid = int(out.stdout)
    assert pid not in {p.pid for p in psutil.Process().children(recursive=True)}
    return pid


def _end(pid: int) -> None:
    """SIGKILL ``pid`` (started by :func:`_outsider`) and wait until it no longer runs."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while programs._alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture
def outsider():
    started: list[int] = []

    def start(seconds: int = 60) -> int:
        started.append(_outsider(seconds))
        return started[-1]

    yield start
    for pid in started:
        _end(pid)


# ------------------------------------------------------------------ the spec and the setting
def test_the_emulated_spec_declares_programs_and_a_bad_one_names_the_item_and_the_fix():
    a, b = parse_emulated("H100:80GiB@4242:60GiB@7:1GiB,L4:24GiB")
    assert a.emulated_use == ((4242, 60 * GiB), (7, GiB)) and b.emulated_use == ()
    assert a.memory_total == 80 * GiB and a.name == "H100 (emulated)"
    for spec, names in [
        ("H100:80GiB@x:1GiB", "'@x:1GiB' is not @PID:MEMORY"),
        ("H100:80GiB@0:1GiB", "a process id above 0"),
        ("H100:80GiB@12", "'@12' is not @PID:MEMORY"),
        ("L4:24GiB,H100:80GiB@12:lots", "item 2 ('H100:80GiB@12:lots'): '@12:lots' is not @PID:MEMORY"),
        ("H100:80GiB@12:9..GiB", "item 1's @12 has a bad memory size '9..GiB'"),
        (
            "H100:80GiB@12:50GiB@13:40GiB",
            "declares programs using 90.00 GiB, more than the device's 80.00 GiB",
        ),
    ]:
        with pytest.raises(DeviceDiscoveryError) as err:
            parse_emulated(spec)
        assert names in str(err.value) and '"H100:80GiB@4242:60GiB"' in str(err.value), str(err.value)


def test_a_bad_other_programs_memory_setting_names_the_variable_and_the_form(monkeypatch, lease_dir):
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "1")
    monkeypatch.setenv("GPU_TASKS_OTHER_PROGRAMS_MEMORY", "lots")
    result = CliRunner().invoke(app, ["devices"])
    assert result.exit_code == 2
    assert "GPU_TASKS_OTHER_PROGRAMS_MEMORY" in result.stderr and "1GiB, 512MiB" in result.stderr
    assert "'lots'" in result.stderr
    monkeypatch.setenv("GPU_TASKS_OTHER_PROGRAMS_MEMORY", "512MiB")
    assert DeviceBook().other_programs_memory == 512 * 2**20


# ------------------------------------------------------------------ the sampler and the book
def test_sample_names_a_running_outsider_and_forgets_it_when_it_ends(outsider, lease_dir):
    pid = outsider()
    own = subprocess.Popen(["sleep", "60"])  # this (flow) process's child: gpu-tasks' own
    try:
        dev0, dev1 = parse_emulated(f"H100:80GiB@{pid}:60GiB,H100:80GiB@{own.pid}:10GiB")
        use = programs.sample([dev0, dev1])
        [program] = use["0"].programs
        assert (program.pid, program.memory, program.user, program.command) == (pid, 60 * GiB, ME, "sleep 60")
        assert use["0"].source == "emulated" and use["0"].free == 20 * GiB
        assert use["1"].programs == () and use["1"].free == 70 * GiB, "its own child is no other program"
        reason = programs.blocked(use["0"], GiB)
        assert reason and f"pid {pid} (user {ME}, 'sleep 60') using 60.00 GiB" in reason
        assert "GPU_TASKS_OTHER_PROGRAMS_MEMORY" in reason
        _end(pid)
        after = programs.sample([dev0])["0"]
        assert after.programs == () and after.free == 80 * GiB and programs.blocked(after, 0) is None
    finally:
        own.kill()
        own.wait()


# a process that leases device 1 the way a flow run does (an flock on its lock file, JSON naming it),
# starts a child, prints the child's pid and sleeps: the child is gpu-tasks' own
LEASE_HOLDER = textwrap.dedent(
    """
    import fcntl, json, os, socket, subprocess, sys, time
    fd = os.open(os.path.join(sys.argv[1], "device-1.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": os.getpid(), "hostname": socket.gethostname()}).encode())
    child = subprocess.Popen(["sleep", "60"])
    print(child.pid, flush=True)
    time.sleep(60)
    """
)


def test_a_program_that_ends_while_it_is_read_is_not_named():
    """Sampling reads a process in steps (alive? ours? user, command); one that ends between them
    (here: already a zombie, whose command line can no longer be read) uses nothing now and is not
    named. Seen on a loaded machine: the wait was recorded twice, the second time with 'command
    not visible', for a program that was exiting."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:  # ended, not reaped
            assert time.monotonic() < deadline, "the child did not end"
            time.sleep(0.02)
        assert programs._program(child.pid, 2**30, set()) is None
    finally:
        child.wait()


def test_a_lease_holders_descendants_are_gpu_tasks_own(tmp_path, lease_dir):
    lease_dir.mkdir(parents=True)
    script = tmp_path / "holder.py"
    script.write_text(LEASE_HOLDER)
    out = subprocess.run(  # detached, like a flow run of another terminal
        ["sh", "-c", f"{sys.executable} {script} {lease_dir} > {tmp_path / 'pid'} 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
    )
    holder = int(out.stdout)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "pid").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.02)
        worker = int((tmp_path / "pid").read_text())
        assert leases.holders(lease_dir, ["1"])["1"] == {"pid": holder, "hostname": socket.gethostname()}
        [dev] = parse_emulated(f"H100:80GiB@{worker}:60GiB")
        assert programs.sample([dev])["0"].programs == (), "a lease holder's child is no other program"
        _end(holder)  # its lease goes with it: the orphaned child is now a program outside gpu-tasks
        assert [p.pid for p in programs.sample([dev])["0"].programs] == [worker]
    finally:
        _end(holder)
        _end(worker)


def test_the_book_skips_a_device_outsiders_use_and_takes_it_once_they_leave(outsider, lease_dir):
    pid, idle = outsider(), outsider()
    dev0, dev1 = parse_emulated(f"H100:80GiB@{pid}:60GiB,H100:80GiB@{idle}:0")
    book = DeviceBook(other_programs_memory=GiB)
    assert book.acquire("gpu", [(dev0,)], 1, block=False) == []
    [why] = book.skips("gpu")
    assert why.startswith(f"device 0: used by pid {pid} (user {ME}, 'sleep 60') using 60.00 GiB: more than")
    assert leases.holders(lease_dir, ["0"]) == {"0": None}, "the lease is given back"
    # under the limit, the device is leased
    lenient = DeviceBook(other_programs_memory=100 * GiB)
    assert lenient.acquire("gpu", [(dev0,)], 1, block=False) == [0]
    lenient.release("gpu", ["0"])
    # a need above its free memory keeps the profile off it, whatever the limit
    assert lenient.acquire("big", [(dev0,)], 1, block=False, need_memory=21 * GiB) == []
    assert (
        "20.00 GiB free, less than the 21.00 GiB the profile needs free "
        "(gpu_memory_free / gpu_memory_per_task)" in lenient.skips("big")[0]
    )
    assert lenient.acquire("big", [(dev1,)], 1, block=False, need_memory=80 * GiB) == [0]
    lenient.release("big", ["1"])
    # GPU_TASKS_OTHER_PROGRAMS_MEMORY=0: any program on the device keeps gpu-tasks off it
    strict = DeviceBook(other_programs_memory=0)
    assert strict.acquire("gpu", [(dev1,)], 1, block=False) == []
    assert "GPU_TASKS_OTHER_PROGRAMS_MEMORY=0" in strict.skips("gpu")[0]
    _end(idle)
    _end(pid)
    assert strict.acquire("gpu", [(dev0,), (dev1,)], 2, block=False) == [0, 1]
    assert strict.skips("gpu") == []
    strict.release("gpu", ["0", "1"])


def test_the_lease_timeout_offers_to_raise_the_other_programs_limit_when_that_is_the_cause(
    outsider, lease_dir
):
    from gpu_tasks.errors import ClusterError

    pid = outsider()
    (dev,) = parse_emulated(f"H100:80GiB@{pid}:60GiB")
    book = DeviceBook(other_programs_memory=GiB, lease_timeout=0.5)
    with pytest.raises(ClusterError) as info:
        book.acquire("gpu", [(dev,)], 1, block=True)
    fix = "raise GPU_TASKS_OTHER_PROGRAMS_MEMORY (now 1.00 GiB) above what they use"
    assert fix in str(info.value) and "raise GPU_TASKS_LEASE_TIMEOUT (now 0.5s)" in str(info.value)
    # too little free memory is no matter of that limit: it is not offered
    roomy = DeviceBook(other_programs_memory=100 * GiB, lease_timeout=0.5)
    with pytest.raises(ClusterError) as info:
        roomy.acquire("big", [(dev,)], 1, block=True, need_memory=30 * GiB)
    said = str(info.value)
    assert "less than the 30.00 GiB" in said and "OTHER_PROGRAMS_MEMORY (now" not in said, said


def test_cli_devices_names_the_programs_on_each_device(outsider, lease_dir, monkeypatch):
    pid = outsider()
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", f"H100:80GiB@{pid}:60GiB,H100:80GiB")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "300")  # the whole table on one line a row
    data = json.loads(CliRunner().invoke(app, ["devices", "--json"]).stdout)
    others = {d["address"]: d["other_programs"] for d in data["devices"]}
    assert others["0"]["sampled"] == "emulated" and others["0"]["free"] == 20 * GiB
    assert others["0"]["programs"] == [
        {"pid": pid, "memory": 60 * GiB, "user": ME, "command": "sleep 60", "hidden": ""}
    ]
    assert others["1"]["programs"] == [] and others["1"]["free"] == 80 * GiB
    # the memory free now, as the table shows it (it was the device's size)
    assert {d["address"]: d["memory_free"] for d in data["devices"]} == {"0": 20 * GiB, "1": 80 * GiB}
    table = CliRunner().invoke(app, ["devices"]).stdout
    rows = [line.split("│") for line in table.splitlines() if line.count("│") > 2]
    first = next(i for i, cells in enumerate(rows) if cells[1].strip() == "0")  # device 0's row, folded
    cell = " ".join(cells[-2].strip() for cells in rows[first:] if cells[1].strip() in ("0", ""))
    assert rows[first][4].strip() == "20.00 GiB", "memory free now"
    assert f"pid {pid} (user {ME}, 'sleep 60') using 60.00 GiB" in cell
    assert "more than GPU_TASKS_OTHER_PROGRAMS_MEMORY (1.00 GiB), gpu-tasks does not lease it" in cell
    assert next(cells[-2].strip() for cells in rows if cells[1].strip() == "1") == "none"
    monkeypatch.setenv("GPU_TASKS_OTHER_PROGRAMS_MEMORY", "0")  # any use at all: not "more than 0"
    table = CliRunner().invoke(app, ["devices"]).stdout
    said = " ".join(line.split("│")[-2].strip() for line in table.splitlines() if line.count("│") > 2)
    zero = "no other program may use it (GPU_TASKS_OTHER_PROGRAMS_MEMORY=0), gpu-tasks does not lease it"
    assert zero in said, said


# ------------------------------------------------------------------ a flow run
class _Said(logging.Handler):
    """The device book's log lines (on its logger itself: a flow run's logging setup replaces the
    root logger's handlers, caplog's among them)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def naming(self, pid: int) -> list[str]:
        return [line for line in list(self.lines) if f"pid {pid} (" in line]


@contextlib.contextmanager
def _book_lines() -> Iterator[_Said]:
    book, said = logging.getLogger("gpu_tasks.devices.book"), _Said()
    level = book.level
    book.setLevel(logging.INFO)
    book.addHandler(said)
    try:
        yield said
    finally:
        book.removeHandler(said)
        book.setLevel(level)


@pytest.mark.usefixtures("prefect_server")
def test_a_gpu_task_waits_while_another_program_uses_its_device_then_runs_there(
    outsider, lease_dir, monkeypatch
):
    from prefect import flow, task
    from prefect.context import FlowRunContext

    pid = outsider()
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", f"H100:80GiB@{pid}:60GiB")
    ended: dict[str, float] = {}

    def end_it_once_named(said: _Said) -> None:
        deadline = time.monotonic() + 60
        while not said.naming(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the task keeps waiting: it has not started
        ended["at"] = time.time()
        _end(pid)

    @task(tags=[profile("gpu")])
    def on_device() -> dict:
        return {"devices": list(current_allocation().devices), "started": time.time()}

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, idle_timeout=0.5)]))
    def f() -> tuple:
        return on_device.submit().result(), FlowRunContext.get().task_runner

    with _book_lines() as said:
        threading.Thread(target=end_it_once_named, args=(said,), daemon=True).start()
        row, runner = f()
    lines = said.naming(pid)
    assert lines, f"no wait line named pid {pid}: {said.lines}"
    assert lines[0].startswith(
        "profile 'gpu': waiting for devices that programs outside gpu-tasks use: device 0:"
    )
    assert (
        f"pid {pid} (user {ME}, 'sleep 60') using 60.00 GiB" in lines[0]
        and "GPU_TASKS_LEASE_TIMEOUT" in lines[0]
    )
    assert row["devices"] == ["0"] and row["started"] > ended["at"], "ran only after the program ended"
    [ledger] = runner.ledger
    assert ledger.devices == ("0",) and ledger.wait_devices_seconds >= 0.5
    assert len(ledger.skipped) == 1 and ledger.skipped[0].startswith(
        f"device 0: used by pid {pid} (user {ME}"
    )
    assert ledger.as_dict()["skipped"] == list(ledger.skipped)


@pytest.mark.usefixtures("prefect_server")
def test_gpu_memory_total_picks_by_size_and_gpu_memory_free_waits_for_free_memory(
    outsider, lease_dir, monkeypatch
):
    """The two halves of the old ``gpu_memory``: a device's size (checked before a lease) and its
    free memory at the lease (docs/profiles.md, "Kinds: local only")."""
    from prefect import flow, task

    pid = outsider()
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", f"H100:80GiB@{pid}:60GiB,L4:24GiB")
    monkeypatch.setenv("GPU_TASKS_OTHER_PROGRAMS_MEMORY", "100GiB")  # only the free memory counts here
    size = ResourceProfile(name="size", gpus=1, gpu_memory_total="30GiB", idle_timeout=0.2)
    free = ResourceProfile(name="free", gpus=1, gpu_memory_free="30GiB", idle_timeout=0.2)
    ended: dict[str, float] = {}

    def end_it_once_named(said: _Said) -> None:
        deadline = time.monotonic() + 60
        while not [x for x in said.naming(pid) if "profile 'free'" in x] and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the task keeps waiting: it has not started
        ended["at"] = time.time()
        _end(pid)

    @task
    def on_device() -> dict:
        return {"devices": list(current_allocation().devices), "started": time.time()}

    @flow(task_runner=ProfileTaskRunner(profiles=[size, free]))
    def f() -> tuple[dict, dict]:
        by_size = on_device.with_options(tags=[profile("size")]).submit().result()
        return by_size, on_device.with_options(tags=[profile("free")]).submit().result()

    with _book_lines() as said:
        threading.Thread(target=end_it_once_named, args=(said,), daemon=True).start()
        by_size, by_free = f()
    # 30 GiB total: the H100 (20 GiB free) at once, never the 24 GiB L4
    assert by_size["devices"] == ["0"] and by_size["started"] < ended["at"], (
        "ran while the program held 60 GiB"
    )
    # 30 GiB free: the same H100 only once the program holding 60 GiB of it has ended
    lines = [x for x in said.naming(pid) if "profile 'free'" in x]
    assert lines and "20.00 GiB free, less than the 30.00 GiB the profile needs free" in lines[0], said.lines
    assert by_free["devices"] == ["0"] and by_free["started"] > ended["at"], "ran only after it had room"
