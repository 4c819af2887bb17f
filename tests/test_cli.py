"""The gpu-tasks command line (typer), run in-process with CliRunner."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpu_tasks.cli import app
from gpu_tasks.devices import discovery as devices_module
from gpu_tasks.devices.discovery import Device

EMULATED = "H100:80GiB,L4:24GiB"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _plain(text: str) -> str:
    return _ANSI.sub("", text)


@pytest.fixture
def env(monkeypatch):
    """Two emulated devices; no profiles file, no discovery command."""
    for var in (
        "GPU_TASKS_PROFILES_FILE",
        "GPU_TASKS_DISCOVERY_COMMAND",
        "GPU_TASKS_IDLE_TIMEOUT",
        "FORCE_COLOR",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", EMULATED)
    monkeypatch.setenv("NO_COLOR", "1")
    return monkeypatch


@pytest.fixture
def runner():
    return CliRunner()


def _ok(result) -> str:
    assert result.exit_code == 0, (result.output, result.exception)
    return _plain(result.stdout)


def _failed(result) -> str:
    """A user error: exit code 2, the message on stderr, no traceback."""
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert result.stdout == ""
    return _plain(result.stderr)


# ------------------------------------------------------------------ devices
def test_devices_lists_emulated_devices(env, runner):
    out = _ok(runner.invoke(app, ["devices"]))
    assert "H100 (emulated)" in out and "L4 (emulated)" in out
    assert "EMULATED devices: no real GPU; workers get CUDA_VISIBLE_DEVICES" in out
    assert "(GPU_TASKS_EMULATED_GPUS='H100:80GiB,L4:24GiB')" in out
    # what emulation means for any flow; nothing of the example pipeline's libraries
    assert "CUDA_VISIBLE_DEVICES and Dask GPU resources" in out and "tasks compute on the CPU" in out
    assert not re.search("pandas|cuDF|XGBoost", out), out
    assert "emulated" in out.lower()


def test_devices_json(env, runner):
    result = runner.invoke(app, ["devices", "--json"])
    data = json.loads(_ok(result))
    assert data["source"] == "emulated" and data["emulated"] is True
    assert [d["name"] for d in data["devices"]] == ["H100 (emulated)", "L4 (emulated)"]
    assert [d["address"] for d in data["devices"]] == ["0", "1"]
    assert [d["memory_total"] for d in data["devices"]] == [80 * 2**30, 24 * 2**30]
    assert all(d["emulated"] for d in data["devices"])


@pytest.mark.processes
def test_devices_from_discovery_command(env, runner, tmp_path):
    script = tmp_path / "disc.py"
    script.write_text('print(\'{"name": "gpu", "addresses": ["0", "1", "2"]}\')\n')
    env.delenv("GPU_TASKS_EMULATED_GPUS")
    env.setenv("GPU_TASKS_DISCOVERY_COMMAND", f"{sys.executable} {script}")
    out = _ok(runner.invoke(app, ["devices"]))
    assert "discovery command" in out and "disc.py" in out
    assert "EMULATED" not in out
    data = json.loads(_ok(runner.invoke(app, ["devices", "--json"])))
    assert data["source"] == "command" and [d["address"] for d in data["devices"]] == ["0", "1", "2"]


def test_devices_from_nvml(env, runner):
    env.delenv("GPU_TASKS_EMULATED_GPUS")
    dev = Device(address="0", index=0, name="NVIDIA L4", memory_total=24 * 2**30, compute_capability="8.9")
    env.setattr(devices_module, "nvml_devices", lambda: ((dev,), "1 device(s) from NVML"))
    out = _ok(runner.invoke(app, ["devices"]))
    assert "NVIDIA L4" in out and "8.9" in out
    assert "Source: NVML (1 device(s) from NVML)" in out
    assert "EMULATED" not in out


def test_devices_when_there_are_none(env, runner):
    env.delenv("GPU_TASKS_EMULATED_GPUS")
    env.setattr(devices_module, "nvml_devices", lambda: ((), "no NVIDIA driver (NVMLError_LibraryNotFound)"))
    out = _ok(runner.invoke(app, ["devices"]))
    # no devices: how to try flows here anyway (emulation, what it means; or the CPU fallback)
    assert "No devices: GPU profiles cannot run here" in out
    assert "GPU_TASKS_EMULATED_GPUS=2 (no real GPU; workers get CUDA_VISIBLE_DEVICES" in out
    assert "fallback='cpu'" in out
    assert "no GPUs found (no NVIDIA driver (NVMLError_LibraryNotFound))" in out
    data = json.loads(_ok(runner.invoke(app, ["devices", "--json"])))
    assert data == {
        "source": "none",
        "emulated": False,
        "detail": "no NVIDIA driver (NVMLError_LibraryNotFound)",
        "devices": [],
        "waiters": [],
    }


def test_devices_with_zero_emulated_says_none_are_emulated_and_the_fix(env, runner):
    """GPU_TASKS_EMULATED_GPUS=0: no line says devices are EMULATED, nor asks to set what is set."""
    env.setenv("GPU_TASKS_EMULATED_GPUS", "0")
    out = _ok(runner.invoke(app, ["devices"]))
    assert "EMULATED devices" not in out and "set GPU_TASKS_EMULATED_GPUS=2 (" not in out, out
    assert "No devices: GPU_TASKS_EMULATED_GPUS='0' emulates none and hides this host's GPUs" in out, out
    assert "Unset it to use this host's GPUs, or set GPU_TASKS_EMULATED_GPUS=2 to emulate 2 devices" in out
    assert "Source: 0 emulated devices (GPU_TASKS_EMULATED_GPUS='0'); real GPUs are not looked for" in out


@pytest.mark.processes
def test_devices_piped_without_columns_keeps_the_tables_cells_whole(env):
    """Output to no terminal (a pipe) and no COLUMNS: rich's 80 columns cut the cells (`Addre ss`)."""
    environ = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run(
        [sys.executable, "-m", "gpu_tasks.cli", "devices"],
        env=environ,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    header = next((line for line in out.splitlines() if "Address" in line), "")
    assert all(name in header for name in ("Memory total", "Compute capability", "Other programs")), out


@pytest.mark.parametrize("value", ["H100:lots", "65", "H100:80GiB,,L4"])
def test_devices_bad_emulated_env(env, runner, value):
    env.setenv("GPU_TASKS_EMULATED_GPUS", value)
    err = _failed(runner.invoke(app, ["devices"]))
    assert err.startswith("error: GPU_TASKS_EMULATED_GPUS must be a count")
    err = _failed(runner.invoke(app, ["devices", "--json"]))
    assert "GPU_TASKS_EMULATED_GPUS" in err


@pytest.mark.processes
def test_devices_bad_discovery_command(env, runner, tmp_path):
    env.delenv("GPU_TASKS_EMULATED_GPUS")
    script = tmp_path / "disc.py"
    script.write_text("print('not json')\n")
    env.setenv("GPU_TASKS_DISCOVERY_COMMAND", f"{sys.executable} {script}")
    err = _failed(runner.invoke(app, ["devices"]))
    assert "GPU_TASKS_DISCOVERY_COMMAND" in err and "must print JSON" in err


def test_bad_setting_is_named(env, runner):
    env.setenv("GPU_TASKS_IDLE_TIMEOUT", "-1")
    err = _failed(runner.invoke(app, ["devices"]))
    assert "GPU_TASKS_IDLE_TIMEOUT" in err and "'-1'" in err


# ----------------------------------------------------------------- profiles
PROFILES = textwrap.dedent(
    """
    [profiles.etl]
    gpus = 0.25
    gpu_model = "H100"
    memory = "8GiB"

    [profiles.big]
    gpus = 1
    gpu_model = "A100"

    [profiles.train]
    gpus = 2
    gang = true
    max_workers = 1
    fallback = "cpu"
    idle_timeout = 5
    """
)


@pytest.fixture
def profiles_file(tmp_path):
    path = tmp_path / "profiles.toml"
    path.write_text(PROFILES)
    return path


def test_profiles_file_shows_unrunnable_profile_and_why(env, runner, profiles_file):
    out = _ok(runner.invoke(app, ["profiles", "--file", str(profiles_file)]))
    assert f"Profiles from {profiles_file}" in out
    for tag in ("profile:etl", "profile:big", "profile:train", "profile:cpu"):
        assert tag in out
    line = next(line for line in out.splitlines() if line.startswith("CANNOT RUN 'big'"))
    assert "gpu_model='A100'" in line and "no device matches" in line
    assert "H100 (emulated)" in line and "L4 (emulated)" in line
    assert not any(line.startswith(("CANNOT RUN 'etl'", "CANNOT RUN 'train'")) for line in out.splitlines())
    assert "EMULATED devices: no real GPU" in out
    # the fields of each profile are shown
    for field in (
        "cpus",
        "gpus",
        "memory",
        "gpu_model",
        "gpu_memory_total",
        "gpu_memory_free",
        "max_workers",
        "idle_timeout",
        "fallback",
        "gang",
    ):
        assert re.search(rf"│ {field}\s+│", out), field
    assert "8.00 GiB" in out and "A100" in out


def test_a_remote_profiles_table_shows_its_kind_and_only_the_fields_it_takes(env, runner, tmp_path):
    """An address profile's table had cpus, memory, max_workers ("no cap (one worker per device
    group)") and fallback rows, which that kind does not take, and no kind (a new-user pass)."""
    path = tmp_path / "remote.toml"
    path.write_text('[profiles.shared]\ngpus = 1\naddress = "tcp://127.0.0.1:8786"\nidle_timeout = 60\n')
    out = _ok(runner.invoke(app, ["profiles", "--file", str(path)]))
    table = out.split("cpu (default for untagged tasks)", 1)[0]  # the file's one profile, then the built-in
    assert re.search(r"│ kind\s+│ address", table), table
    for field in ("gpus", "gpu_model", "idle_timeout"):
        assert re.search(rf"│ {field}\s+│", table), field
    for field in ("cpus", "memory", "gpu_memory_free", "max_workers", "fallback", "gang"):
        assert not re.search(rf"│ {field}\s+│", table), (field, table)


def test_profiles_json(env, runner, profiles_file):
    data = json.loads(_ok(runner.invoke(app, ["profiles", "--file", str(profiles_file), "--json"])))
    assert data["file"] == str(profiles_file)
    assert data["default"] == "cpu"
    assert data["devices"]["source"] == "emulated" and data["devices"]["addresses"] == ["0", "1"]
    by_name = {p["name"]: p for p in data["profiles"]}
    assert set(by_name) == {"etl", "big", "train", "cpu"}
    assert by_name["big"]["can_run"] is False
    assert "A100" in by_name["big"]["reason"] and by_name["big"]["matching_devices"] == []
    assert by_name["etl"]["can_run"] is True and by_name["etl"]["reason"] is None
    assert by_name["etl"]["matching_devices"] == ["0"]
    assert by_name["etl"]["tasks_per_worker"] == 4 and by_name["etl"]["workers"] == 1
    assert by_name["etl"]["memory"] == 8 * 2**30
    assert by_name["train"]["matching_devices"] == ["0", "1"] and by_name["train"]["workers"] == 1
    assert by_name["train"]["gang"] is True and by_name["train"]["idle_timeout"] == 5
    assert by_name["cpu"]["default"] is True and by_name["cpu"]["gpus"] == 0


def test_profiles_read_the_env_file(env, runner, profiles_file):
    env.setenv("GPU_TASKS_PROFILES_FILE", str(profiles_file))
    data = json.loads(_ok(runner.invoke(app, ["profiles", "--json"])))
    assert data["file"] == str(profiles_file)
    assert {p["name"] for p in data["profiles"]} == {"etl", "big", "train", "cpu"}


def test_profiles_without_a_file_show_the_builtin_cpu_profile(env, runner):
    out = _ok(runner.invoke(app, ["profiles"]))
    assert "No profiles file set" in out and "GPU_TASKS_PROFILES_FILE" in out
    assert "profile:cpu" in out and "CPU only" in out
    assert "CANNOT RUN" not in out
    data = json.loads(_ok(runner.invoke(app, ["profiles", "--json"])))
    assert data["file"] is None
    assert [p["name"] for p in data["profiles"]] == ["cpu"]
    assert data["profiles"][0]["can_run"] is True


def test_profiles_without_gpus(env, runner, profiles_file):
    env.delenv("GPU_TASKS_EMULATED_GPUS")
    env.setattr(devices_module, "nvml_devices", lambda: ((), "no NVIDIA driver (NVMLError_LibraryNotFound)"))
    data = json.loads(_ok(runner.invoke(app, ["profiles", "-f", str(profiles_file), "--json"])))
    reasons = {p["name"]: p["reason"] for p in data["profiles"]}
    assert reasons["cpu"] is None
    assert all("no NVIDIA driver" in reasons[n] for n in ("etl", "big", "train"))


def test_profiles_default_from_file(env, runner, tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('default = "light"\n[profiles.light]\ncpus = 0.5\n')
    data = json.loads(_ok(runner.invoke(app, ["profiles", "-f", str(path), "--json"])))
    assert [(p["name"], p["default"]) for p in data["profiles"]] == [("light", True)]
    assert "light (default for untagged tasks)" in _ok(runner.invoke(app, ["profiles", "-f", str(path)]))


def test_profiles_tables_show_what_a_placement_depends_on(env, runner, tmp_path, monkeypatch):
    """A memory-request profile's table names its request (it showed gpus 0 alone), and a 2-GPU
    profile's devices read as a pick of two, not as all of them."""
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "3")
    path = tmp_path / "p.toml"
    path.write_text(
        '[profiles.mem]\ngpu_memory_per_task = "4GiB"\non_oom = "pair"\n'
        '[profiles.pair]\ngpus = 2\npreemptible = true\nquota = "team-a"\n'
    )
    out = _ok(runner.invoke(app, ["profiles", "-f", str(path)]))
    for field, value in (("gpu_memory_per_task", "4.00 GiB"), ("on_oom", "pair"), ("preemptible", "yes")):
        assert re.search(rf"{field}\s+│ {re.escape(value)}", out), (field, out)
    assert re.search(r"quota\s+│ team-a", out) and "2 of devices 0, 1, 2" in out, out


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("[profiles.etl]\ngpus = 0.3\n", ["profile 'etl'", "gpus", "0.3"]),
        ("[profiles.etl\n", ["is not valid TOML"]),
        (
            'default = "nope"\n[profiles.a]\ncpus = 1\n',
            ["default profile 'nope' is not defined", "known profiles: a"],
        ),
        ('default = "g"\n[profiles.g]\ngpus = 1\n', ["default profile 'g' must be a CPU profile"]),
    ],
)
def test_profiles_bad_file(env, runner, tmp_path, text, needles):
    path = tmp_path / "p.toml"
    path.write_text(text)
    err = _failed(runner.invoke(app, ["profiles", "--file", str(path)]))
    assert str(path) in err
    for needle in needles:
        assert needle in err


def test_profiles_missing_file(env, runner, tmp_path):
    path = tmp_path / "missing.toml"
    err = _failed(runner.invoke(app, ["profiles", "--file", str(path)]))
    # the message names the input the user gave: the option, not a variable they never set
    assert err.startswith(f"error: profiles file {str(path)!r} (--file) cannot be read"), err
    assert "give --file an existing TOML file" in err and "GPU_TASKS_PROFILES_FILE" not in err, err
    env.setenv("GPU_TASKS_PROFILES_FILE", str(path))
    err = _failed(runner.invoke(app, ["profiles", "--json"]))
    assert "(GPU_TASKS_PROFILES_FILE) cannot be read" in err
    assert "point GPU_TASKS_PROFILES_FILE at an existing TOML file" in err


def test_profiles_bad_devices(env, runner, profiles_file):
    env.setenv("GPU_TASKS_EMULATED_GPUS", "H100:-1")
    err = _failed(runner.invoke(app, ["profiles", "--file", str(profiles_file)]))
    assert "GPU_TASKS_EMULATED_GPUS" in err


# --------------------------------------------------------------------- app
def test_no_arguments_shows_help(env, runner):
    result = runner.invoke(app, [])
    out = _plain(result.output)
    assert "Usage" in out and "devices" in out and "profiles" in out
    assert result.exit_code in (0, 2)  # click >= 8.2 exits 2 for no_args_is_help


def _commands(help_text: str) -> list[str]:
    """The command names of a help page's Commands box, in order."""
    box = help_text.split("Commands")[1]
    return re.findall(r"^[│|] (\S+) ", box, flags=re.MULTILINE)


def test_help_lists_the_plugins_commands_and_the_example_apart(env, runner):
    """`run` and `serve` are the example pipeline's: under `gpu-tasks example`, listed last."""
    top = _commands(_ok(runner.invoke(app, ["--help"])))
    assert top[-1] == "example" and "run" not in top and "serve" not in top, top
    assert {"devices", "profiles", "waiters", "deployment-info", "leases", "quotas"} <= set(top), top
    assert _commands(_ok(runner.invoke(app, ["example", "--help"]))) == ["run", "serve"]


def test_every_command_has_help(env, runner):
    for command in ("devices", "profiles", "waiters"):
        result = runner.invoke(app, [command, "--help"])
        out = _ok(result)
        assert "--json" in out
    assert "--file" in _ok(runner.invoke(app, ["profiles", "--help"]))


def test_the_app_reads_its_command_line(env, monkeypatch, capsys):
    """As the ``gpu-tasks`` script and ``python -m gpu_tasks.cli`` call it: ``app()``, arguments from argv."""
    monkeypatch.setattr(sys, "argv", ["gpu-tasks", "devices", "--json"])
    with pytest.raises(SystemExit) as info:
        app()
    assert info.value.code == 0
    assert json.loads(capsys.readouterr().out)["source"] == "emulated"


# ------------------------------------------------------------ the example pipeline
def _without_the_pipeline_extra(*args: str) -> subprocess.CompletedProcess[str]:
    """``gpu-tasks ARGS`` in a fresh process where xgboost cannot be imported."""
    code = (
        "import sys; sys.modules['xgboost'] = None; sys.argv = ['gpu-tasks', *sys.argv[1:]]; "
        "from gpu_tasks.cli import app; app()"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "NO_COLOR": "1",
        "PREFECT_API_URL": "http://127.0.0.1:9/api",
        "GPU_TASKS_EMULATED_GPUS": "1",
    }
    return subprocess.run(
        [sys.executable, "-c", code, *args, "--limit", "1000"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )


@pytest.mark.processes
@pytest.mark.parametrize("command", ["run", "serve"])
def test_example_commands_without_the_pipeline_extra_say_what_to_install(command):
    """Without the pipeline's libraries (here: xgboost blocked), `example run/serve` exit 2 with one
    line."""
    proc = _without_the_pipeline_extra("example", command)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        f"gpu-tasks example {command} needs the example pipeline's libraries: pip install "
        "'gpu-tasks[pipeline]'" in lines[0]
    ), lines
    assert "xgboost" in lines[0] and proc.stdout == ""


@pytest.mark.processes
@pytest.mark.parametrize("command", ["run", "serve"])
def test_the_old_spellings_still_work_and_name_the_new_one(command):
    """`gpu-tasks run` / `serve` (scripts and deployments may call them): hidden from --help, one
    warning line naming `gpu-tasks example ...`, then the command itself."""
    proc = _without_the_pipeline_extra(command)
    assert proc.returncode == 2, proc.stderr[-2000:]
    warning, error = proc.stderr.strip().splitlines()
    assert warning == (
        f"warning: `gpu-tasks {command}` is deprecated, use `gpu-tasks example {command}` (the example "
        "pipeline's commands are apart from the plugin's)"
    ), warning
    assert error.startswith(f"error: gpu-tasks example {command} needs the example pipeline's"), error


# ------------------------------------------------------------------ waiters
@pytest.fixture
def lease_dir(env, tmp_path):
    path = tmp_path / "leases"
    env.setenv("GPU_TASKS_LEASE_DIR", str(path))
    return path


def test_waiters_lists_this_hosts_queue(env, runner, lease_dir):
    """Without an address: the flow runs queued for this host's devices (the lease queue)."""
    from gpu_tasks.devices import leases

    out = _ok(runner.invoke(app, ["waiters"]))
    assert f"No flow run on this host waits for devices (queue in {lease_dir})" in out, out
    info = dict(leases.owner_info("etl"), flow_run_name="queued-run")
    waiter = leases.enqueue(["0"], info, priority=2, arrived=time.time() - 1.5, lease_dir=lease_dir)
    try:
        table = _ok(runner.invoke(app, ["waiters"], env={"COLUMNS": "200"}))
        data = json.loads(_ok(runner.invoke(app, ["waiters", "--json"])))
    finally:
        leases.dequeue(waiter)
    assert "Waiting for devices on this host" in table and "queued-run" in table and "etl" in table, table
    assert data["lease_dir"] == str(lease_dir) and data["address"] is None and data["waiters"] == []
    [queued] = data["this_host"]
    assert queued["profile"] == "etl" and queued["priority"] == 2 and queued["addresses"] == ["0"]
    assert queued["pid"] == os.getpid() and queued["waited_s"] >= 1.5


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_waiters_on_a_closed_port_fails_at_once_as_an_input_error(env, runner, lease_dir):
    port = _closed_port()
    address = f"tcp://127.0.0.1:{port}"
    t0 = time.monotonic()
    err = _failed(runner.invoke(app, ["waiters", address, "--timeout", "30"]))
    assert time.monotonic() - t0 < 25, "refused before the 30 s --timeout"
    assert err.strip() == (
        f"error: address {address!r}: connection refused (nothing listens on port {port} of 127.0.0.1); "
        "check the address, and that the scheduler runs and is reachable"
    ), err


def test_waiters_bad_address_names_the_input_not_an_internal_profile(env, runner, lease_dir):
    err = _failed(runner.invoke(app, ["waiters", "gpu-scheduler"]))
    assert "must be a Dask scheduler address" in err and "'gpu-scheduler'" in err, err
    assert "profile" not in err, err
    for value in ("0", "-1", "nan", "inf"):
        err = _failed(runner.invoke(app, ["waiters", "--timeout", value]))
        assert "--timeout must be a number of seconds more than 0" in err, err


@pytest.mark.parametrize("scheme", ["ucx", "ucxx"])
def test_waiters_over_ucx_without_ucx_installed_say_so_at_once(env, runner, lease_dir, scheme):
    import importlib.util

    if importlib.util.find_spec("distributed_ucxx") is not None:
        pytest.skip("UCX is installed here (distributed-ucxx)")
    address = f"{scheme}://127.0.0.1:9"
    t0 = time.monotonic()
    err = _failed(runner.invoke(app, ["waiters", address, "--timeout", "30"]))
    assert time.monotonic() - t0 < 15, "refused before the 30 s --timeout"
    assert err.strip() == (
        f"error: address {address!r}: the {scheme} protocol needs UCX installed (distributed-ucxx; on "
        "PyPI distributed-ucxx-cu12 or -cu13): install it, or give the scheduler's tcp:// address"
    ), err


def test_waiters_at_a_port_that_never_answers_give_up_at_the_timeout(env, runner, lease_dir):
    """Something accepts connections but never speaks Dask (a wrong port): the error comes at --timeout,
    not when the other side closes."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the connections; nothing ever answers on them
        address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        err = _failed(runner.invoke(app, ["waiters", address, "--timeout", "2"]))
        waited = time.monotonic() - t0
    assert waited < 30, f"gave up {waited:.1f} s after it started, with --timeout 2"
    assert f"address {address!r}: no Dask scheduler answered within 2 s (--timeout)" in err, err


def test_a_lease_dir_under_a_file_is_named_by_devices_and_waiters(env, runner, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for lease_dir in (blocker, blocker / "leases"):
        env.setenv("GPU_TASKS_LEASE_DIR", str(lease_dir))
        for command in ("devices", "waiters"):
            result = runner.invoke(app, [command])
            assert result.exit_code == 0, result.output
            said = f"lease directory {str(lease_dir)!r}: {str(blocker)!r} is a file, not a directory"
            assert f"warning: flow runs would fail here: {said}; set GPU_TASKS_LEASE_DIR to" in _plain(
                result.stderr
            ), (command, result.stderr)


def test_leases_setup_names_the_absolute_directory(env, runner, tmp_path):
    """A relative DIR is useless to the other users: every line names it from /."""
    env.chdir(tmp_path)
    err = _failed(runner.invoke(app, ["leases", "setup", "missing/leases", "--group", "root"]))
    assert repr(str(tmp_path / "missing")).rstrip("'") in err, (
        err
    )  # as root: no parent; else: run it with sudo


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["q", "99999999999999999999"], "devices must be at most 2,147,483,647"),
        (["q", "2", "--lending-limit", "-5"], "--lending-limit must be 0 to 2,147,483,647, or -1 to remove"),
        (["q", "2", "--borrowing-limit", "-1"], "--borrowing-limit must be 0 to 2,147,483,647"),
    ],
)
def test_quotas_set_checks_its_numbers_before_asking_prefect(env, runner, args, needle):
    err = _failed(runner.invoke(app, ["quotas", "set", *args]))
    assert needle in err, err


def test_quotas_in_a_broken_prefect_environment_say_why_in_one_line(env, runner, tmp_path):
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    blocker = tmp_path / "file"
    blocker.write_text("")
    with temporary_settings({PREFECT_HOME: str(blocker / "prefect")}, restore_defaults={PREFECT_API_URL}):
        for command in (["quotas"], ["quotas", "set", "q", "2"], ["quotas", "delete", "q"]):
            err = _failed(runner.invoke(app, command))
            assert f"PREFECT_HOME {blocker / 'prefect'} cannot be created" in err, err
            assert len(err.strip().splitlines()) == 1, err
    with temporary_settings({PREFECT_API_URL: "not a url"}):
        err = _failed(runner.invoke(app, ["quotas"]))
        assert "PREFECT_API_URL 'not a url' is not an http(s) URL of a server" in err, err


def test_example_run_with_a_bad_profiles_file_says_so_in_one_line(env, runner, tmp_path):
    """The example's flow module builds its runner, which reads the file: an error, not a traceback."""
    env.setenv("GPU_TASKS_PROFILES_FILE", str(tmp_path / "nope.toml"))
    err = _failed(runner.invoke(app, ["example", "run", "--limit", "1000", "--data-dir", str(tmp_path)]))
    assert f"profiles file '{tmp_path / 'nope.toml'}' (GPU_TASKS_PROFILES_FILE) cannot be read" in err, err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: setup makes root-owned lock files")
def test_leases_setup_leaves_a_lock_file_a_run_holds_alone(env, runner, tmp_path):
    """Run again while a flow run held a device whose lock file a user had made, setup replaced that
    file, and a second user's run then used the device beside the first (a new-user pass, 1 of 1):
    it refuses, naming the device and when to run it again; once the lock is let go it replaces it."""
    import fcntl

    from gpu_tasks.devices.lease_files import lock_path

    shared = tmp_path / "leases"
    args = ["leases", "setup", str(shared), "--group", "root", "--device", "0"]
    _ok(runner.invoke(app, args))
    lock = lock_path(shared, "1")
    lock.write_text("")
    os.chown(lock, 65534, -1)  # a user's own, made by the device's first run
    before = lock.stat().st_ino
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # that run holds device 1
        err = _failed(runner.invoke(app, [*args[:-1], "1"]))
        assert "device(s) 1" in err and "a flow run holds it now" in err and "Run this again" in err, err
        assert lock.stat().st_ino == before and lock.stat().st_uid == 65534
    finally:
        os.close(fd)
    _ok(runner.invoke(app, [*args[:-1], "1"]))
    assert lock.stat().st_uid == 0


def test_profiles_counts_a_memory_packed_profiles_tasks_on_each_device(env, runner, tmp_path):
    """A ``gpu_memory_per_task`` profile runs as many tasks at once as fit in each device's free memory;
    the command showed "1 task(s) each" and "gpus 0" for it (a new-user pass, 2 of 2 profiles)."""
    env.setenv("GPU_TASKS_EMULATED_GPUS", "H100:80GiB,L4:24GiB@4242:20GiB")
    path = tmp_path / "mem.toml"
    path.write_text('[profiles.mem]\ngpu_memory_per_task = "20GiB"\n')
    data = json.loads(_ok(runner.invoke(app, ["profiles", "--file", str(path), "--json"])))
    mem = next(p for p in data["profiles"] if p["name"] == "mem")
    # device 1: 24 GiB less the 20 GiB another program uses: fewer than one, counted as one (memory_slots)
    assert mem["tasks_per_device"] == {"0": 4, "1": 1} and mem["tasks_per_worker"] is None, mem
    table = _ok(runner.invoke(app, ["profiles", "--file", str(path)]))
    assert "by gpu_memory_per_task and the memory free now: 4 on 0, 1 on 1" in table, table
    assert "a device per worker, shared by memory" in table, table
