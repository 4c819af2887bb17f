"""Device discovery: emulated specs, discovery commands, NVML, and their precedence."""

from __future__ import annotations

import json
import shlex
import sys
import textwrap
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_tasks import _gpu
from gpu_tasks.devices import discovery as devices
from gpu_tasks.devices.discovery import (
    DEFAULT_EMULATED_MEMORY,
    Device,
    Inventory,
    discover,
    nvml_devices,
    parse_emulated,
    run_discovery_command,
)
from gpu_tasks.errors import DeviceDiscoveryError
from gpu_tasks.settings import GpuTasksSettings

GiB = 2**30
ENV_VARS = ("GPU_TASKS_EMULATED_GPUS", "GPU_TASKS_DISCOVERY_COMMAND")


@pytest.fixture
def clean_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _script(tmp_path, body: str, name: str = "discover.py") -> str:
    """A discovery command: this interpreter running a small script."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(path))}"


# ---------------------------------------------------------------- emulated
@pytest.mark.parametrize("count", [0, 1, 4, 64])
def test_emulated_count(count):
    devs = parse_emulated(str(count))
    assert len(devs) == count
    assert [d.address for d in devs] == [str(i) for i in range(count)]
    assert [d.index for d in devs] == list(range(count))
    assert all(d.emulated and "(emulated)" in d.name for d in devs)
    assert all(d.memory_total == DEFAULT_EMULATED_MEMORY == d.memory_free for d in devs)
    assert len({d.uuid for d in devs}) == count


def test_emulated_list():
    devs = parse_emulated(" H100:80GiB, H100:80GiB ,L4:24GiB,Tesla T4 : 16 GB,A100 ,EMU:1GiB")
    assert [d.name for d in devs] == [
        "H100 (emulated)",
        "H100 (emulated)",
        "L4 (emulated)",
        "Tesla T4 (emulated)",
        "A100 (emulated)",
        "EMU (emulated)",
    ]
    assert [d.memory_total for d in devs] == [
        80 * GiB,
        80 * GiB,
        24 * GiB,
        16 * 10**9,
        DEFAULT_EMULATED_MEMORY,
        GiB,
    ]
    assert [d.address for d in devs] == ["0", "1", "2", "3", "4", "5"]
    assert all(d.emulated and not d.mig for d in devs)


@given(
    items=st.lists(
        st.tuples(
            st.from_regex(r"\A[A-Za-z][A-Za-z0-9_.\-]{0,12}\Z"),
            st.integers(min_value=1, max_value=512),
        ),
        min_size=1,
        max_size=64,
    )
)
def test_emulated_lists_round_trip(items):
    spec = ",".join(f"{name}:{gib}GiB" for name, gib in items)
    devs = parse_emulated(spec)
    assert [(d.name, d.memory_total) for d in devs] == [(f"{n} (emulated)", g * GiB) for n, g in items]


_BAD_ITEMS = st.sampled_from(
    [
        "",
        " ",
        ":80GiB",
        "H100:",
        "H100:80XB",
        "H100:-5GiB",
        "H100:0",
        "H100:0GiB",
        "H100:0.1",
        "H100:.",
        "H100:..GB",
        "H100:1.2.3GiB",
        "H100:80GiB:1",
        "_H100",
        "-H100",
        "H100!",
        "H100/80GiB",
        "H100:1e9",
        "H100:" + "9" * 400,
        "²",
        "Ｈ100",
        "H100=80GiB",
    ]
)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.one_of(
        st.integers(min_value=65, max_value=10**9).map(str),
        st.just("0" * 3 + "65"),
        st.sampled_from(
            ["", "   ", ",", ",,", "4,", ",H100", "-1", "+4", "4;4", "²", "٣", "banana", "two", "2.5"]
        ),
        st.tuples(
            st.lists(st.just("H100:80GiB"), max_size=3),
            _BAD_ITEMS,
            st.lists(st.just("L4:24GiB"), max_size=3),
        ).map(lambda t: ",".join([*t[0], t[1], *t[2]])),
        st.integers(min_value=65, max_value=80).map(lambda n: ",".join(["A:1GiB"] * n)),
    )
)
def test_bad_emulated_specs_raise_discovery_errors(spec):
    with pytest.raises(DeviceDiscoveryError) as info:
        parse_emulated(spec)
    assert "GPU_TASKS_EMULATED_GPUS" in str(info.value)


@pytest.mark.parametrize("spec", ["banana", "two", "2.5", "H100:80GiB,banana"])
def test_a_word_or_a_fraction_is_no_emulated_device(spec):
    """A typo once gave one device named after it, silently; now the accepted forms are named."""
    with pytest.raises(DeviceDiscoveryError, match="neither a whole count nor a model name") as info:
        parse_emulated(spec)
    assert 'a count such as "4"' in str(info.value) and "NAME:MEMORY" in str(info.value)


@settings(max_examples=300)
@given(spec=st.text(max_size=40) | st.text(alphabet="0123456789H1L4:,.GiMBk -_e", max_size=40))
def test_any_emulated_spec_parses_or_raises_a_discovery_error(spec):
    try:
        devs = parse_emulated(spec)
    except DeviceDiscoveryError as exc:
        assert "GPU_TASKS_EMULATED_GPUS" in str(exc)
    else:
        assert len(devs) <= 64
        assert all(d.emulated and d.memory_total and d.memory_total > 0 for d in devs)


# ---------------------------------------------------------- discovery command
@pytest.mark.processes
def test_discovery_command_good_json(tmp_path):
    cmd = _script(
        tmp_path,
        """
        import json
        print(json.dumps({"name": "gpu", "addresses": ["0", "1", 3]}))
    """,
    )
    devs = run_discovery_command(cmd)
    assert [d.address for d in devs] == ["0", "1", "3"]
    assert [d.index for d in devs] == [0, 1, 2]
    assert not any(d.emulated for d in devs)


@pytest.mark.processes
def test_discovery_command_without_name_defaults_to_gpu(tmp_path):
    cmd = _script(tmp_path, "print('{\"addresses\": []}')\n")
    assert run_discovery_command(cmd) == ()


@pytest.mark.processes
@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("print('GPU 0: H100')\n", "must print JSON"),
        ("print('')\n", "must print JSON"),
        ('print(\'["0", "1"]\')\n', 'must print {"name": "gpu", "addresses": [...]}'),
        ('print(\'{"name": "gpu", "addresses": "0,1"}\')\n', "addresses"),
        ('print(\'{"name": "gpu", "addresses": [[0]]}\')\n', "addresses"),
        ('print(\'{"name": "fpga", "addresses": ["0"]}\')\n', "reported resource 'fpga'"),
        ('print(\'{"name": "gpu", "addresses": ["0", "1", "0"]}\')\n', "duplicate addresses"),
        ('print(\'{"name": "gpu", "addresses": ["1", 1]}\')\n', "duplicate addresses"),
        ("import sys\nsys.stderr.write('driver exploded')\nsys.exit(3)\n", "exited with 3: driver exploded"),
        ("import sys\nsys.exit(1)\n", "exited with 1: no output on stderr"),
    ],
)
def test_discovery_command_failures(tmp_path, body, needle):
    cmd = _script(tmp_path, body)
    with pytest.raises(DeviceDiscoveryError) as info:
        run_discovery_command(cmd)
    msg = str(info.value)
    assert needle in msg
    assert "GPU_TASKS_DISCOVERY_COMMAND" in msg
    assert "discover.py" in msg


@pytest.mark.processes
def test_discovery_command_timeout(tmp_path):
    cmd = _script(tmp_path, "import time\ntime.sleep(30)\n")
    with pytest.raises(DeviceDiscoveryError, match="did not finish within 0.5s"):
        run_discovery_command(cmd, timeout=0.5)


@pytest.mark.processes
@pytest.mark.parametrize("command", ["/nonexistent/discover-gpus", "'unbalanced", "", "   "])
def test_discovery_command_that_cannot_start(command):
    with pytest.raises(DeviceDiscoveryError, match="could not start"):
        run_discovery_command(command)


# ------------------------------------------------------------------- NVML
def test_nvml_without_a_driver_reports_why(clean_env):
    found, note = nvml_devices()
    if found:
        pytest.skip(f"this machine has NVIDIA devices: {note}")
    assert found == ()
    assert note.startswith(("NVML not available", "no NVIDIA driver"))
    inv = discover(GpuTasksSettings())
    assert inv.source == "none" and inv.devices == ()
    assert inv.detail == note
    assert note in inv.describe()


def test_nvml_library_missing(monkeypatch):
    def missing(name):
        raise _gpu.GpuLibraryUnavailable(name, "install the GPU extra")

    monkeypatch.setattr(devices._gpu, "load", missing)
    assert nvml_devices() == ((), "NVML not available (install the GPU extra)")


class _NVMLError(Exception):
    pass


def _fake_nvml(mig_on_second: bool = False, init_fails: bool = False) -> SimpleNamespace:
    """A stand-in for pynvml with two H100s; the second optionally split into two MIG instances."""
    calls = {"shutdown": 0}
    mem = SimpleNamespace(total=80 * GiB, free=70 * GiB)
    mig_mem = SimpleNamespace(total=20 * GiB, free=19 * GiB)

    def init():
        if init_fails:
            raise _NVMLError("driver not loaded")

    def mig_mode(handle):
        if handle == ("dev", 1) and mig_on_second:
            return 1, 1
        return 0, 0

    def shutdown():
        calls["shutdown"] += 1

    return SimpleNamespace(
        calls=calls,
        NVML_DEVICE_MIG_ENABLE=1,
        nvmlInit=init,
        nvmlShutdown=shutdown,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: ("dev", i),
        nvmlDeviceGetMemoryInfo=lambda h: mig_mem if h[0] == "mig" else mem,
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0),
        nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetUUID=lambda h: f"MIG-{h[2]}" if h[0] == "mig" else f"GPU-{h[1]}",
        nvmlDeviceGetMigMode=mig_mode,
        nvmlDeviceGetMaxMigDeviceCount=lambda h: 3,
        nvmlDeviceGetMigDeviceHandleByIndex=lambda h, j: (
            ("mig", h[1], j) if j < 2 else (_ for _ in ()).throw(_NVMLError("not found"))
        ),
    )


def test_nvml_devices_from_a_fake_driver(monkeypatch):
    fake = _fake_nvml()
    monkeypatch.setattr(devices._gpu, "load", lambda name: fake)
    found, note = nvml_devices()
    assert note == "2 device(s) from NVML"
    assert [(d.address, d.index, d.uuid) for d in found] == [("0", 0, "GPU-0"), ("1", 1, "GPU-1")]
    assert all(d.name == "NVIDIA H100 80GB HBM3" and d.compute_capability == "9.0" for d in found)
    assert all(d.memory_total == 80 * GiB and d.memory_free == 70 * GiB for d in found)
    assert not any(d.emulated or d.mig for d in found)
    assert fake.calls["shutdown"] == 1


def test_nvml_mig_instances_are_devices(monkeypatch):
    fake = _fake_nvml(mig_on_second=True)
    monkeypatch.setattr(devices._gpu, "load", lambda name: fake)
    found, _ = nvml_devices()
    assert [d.address for d in found] == ["0", "MIG-0", "MIG-1"]
    migs = found[1:]
    assert all(d.mig and d.index == 1 and d.memory_total == 20 * GiB for d in migs)
    assert [d.name for d in migs] == ["NVIDIA H100 80GB HBM3 MIG 0", "NVIDIA H100 80GB HBM3 MIG 1"]


def test_nvml_init_failure_is_a_reason(monkeypatch):
    monkeypatch.setattr(devices._gpu, "load", lambda name: _fake_nvml(init_fails=True))
    assert nvml_devices() == ((), "no NVIDIA driver (_NVMLError)")


@pytest.mark.gpu
def test_nvml_finds_a_real_device(clean_env):
    found, note = nvml_devices()
    if not found:
        pytest.skip(f"no NVIDIA device found by NVML: {note}")
    assert all(d.memory_total and d.memory_total > 0 for d in found)
    assert all(d.name and not d.emulated for d in found)
    assert all(d.compute_capability and d.compute_capability[0].isdigit() for d in found)
    inv = discover(GpuTasksSettings())
    assert inv.source == "nvml" and len(inv.devices) == len(found)


# ------------------------------------------------------------- precedence
def _nvml_says(monkeypatch, *devs: Device):
    monkeypatch.setattr(devices, "nvml_devices", lambda: (tuple(devs), f"{len(devs)} device(s) from NVML"))


def test_emulated_beats_command_and_nvml(clean_env, tmp_path):
    clean_env.setenv("GPU_TASKS_EMULATED_GPUS", "L4:24GiB")
    clean_env.setenv("GPU_TASKS_DISCOVERY_COMMAND", _script(tmp_path, "raise SystemExit(9)\n"))
    _nvml_says(clean_env, Device(address="0", index=0, name="real"))
    inv = discover()
    assert inv.source == "emulated" and inv.emulated
    assert [d.name for d in inv.devices] == ["L4 (emulated)"]
    assert "GPU_TASKS_EMULATED_GPUS='L4:24GiB'" in inv.detail
    assert "emulated" in inv.describe()


@pytest.mark.processes
def test_command_beats_nvml(clean_env, tmp_path):
    cmd = _script(tmp_path, 'print(\'{"name": "gpu", "addresses": ["4", "5"]}\')\n')
    clean_env.setenv("GPU_TASKS_DISCOVERY_COMMAND", cmd)
    _nvml_says(clean_env, Device(address="0", index=0, name="real"))
    inv = discover()
    assert inv.source == "command" and not inv.emulated
    assert [d.address for d in inv.devices] == ["4", "5"]
    assert inv.detail == cmd


def test_nvml_when_nothing_is_set(clean_env):
    _nvml_says(clean_env, Device(address="0", index=0, name="real", memory_total=GiB))
    inv = discover()
    assert inv.source == "nvml" and [d.name for d in inv.devices] == ["real"]
    _nvml_says(clean_env)
    assert discover().source == "none"


def test_emulated_zero_devices_still_wins(clean_env):
    _nvml_says(clean_env, Device(address="0", index=0, name="real"))
    inv = discover(GpuTasksSettings(emulated_gpus="0"))
    assert inv.source == "emulated" and inv.devices == ()


def test_bad_emulated_env_fails_discovery(clean_env):
    clean_env.setenv("GPU_TASKS_EMULATED_GPUS", "H100:lots")
    with pytest.raises(DeviceDiscoveryError, match="GPU_TASKS_EMULATED_GPUS"):
        discover()


def test_blank_command_fails_discovery(clean_env):
    clean_env.setenv("GPU_TASKS_DISCOVERY_COMMAND", "   ")
    with pytest.raises(DeviceDiscoveryError, match="could not start: the command is empty"):
        discover()


@pytest.mark.processes
def test_failing_command_fails_discovery(clean_env, tmp_path):
    clean_env.setenv("GPU_TASKS_DISCOVERY_COMMAND", _script(tmp_path, "print('nope')\n"))
    with pytest.raises(DeviceDiscoveryError, match="must print JSON"):
        discover()


def test_inventory_describe():
    assert Inventory(detail="no driver").describe() == "no GPUs (no driver)"
    inv = Inventory(devices=parse_emulated("H100:80GiB"), source="emulated")
    assert inv.describe() == "1 emulated device(s) from emulated: 0: H100 (emulated) (80.00 GiB)"
    assert Device(address="7", index=7, name="X").describe() == "7: X (memory unknown)"
    assert json.loads(inv.model_dump_json())["devices"][0]["emulated"] is True


@pytest.mark.parametrize("spec", ["h100:80", "H100:80GiB,L4:24"])
def test_an_emulated_memory_without_its_unit_is_refused_with_the_unit_written(spec):
    """A plain number counts bytes: ``h100:80`` gave an 80-byte device, silently (a new-user pass)."""
    with pytest.raises(
        DeviceDiscoveryError, match=r"bytes of memory: write its unit \('(h100:80|L4:24)GiB'\)"
    ):
        parse_emulated(spec)
