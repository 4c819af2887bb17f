"""How devices are wired: emulated shapes, NVML's values mapped, the choice by wiring (pure and in a
flow), and ``gpu-tasks devices``' matrix. NVML itself cannot run here: its reading is tested on a
stand-in module and recorded values (unverified on GPU)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prefect import flow, task
from typer.testing import CliRunner

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile_tag
from gpu_tasks.cli import app
from gpu_tasks.devices import topology as topo
from gpu_tasks.devices.discovery import Device, Inventory, discover, emulated_inventory, parse_emulated
from gpu_tasks.devices.topology import (
    LEVELS,
    Topology,
    add_nvlinks,
    cpu_list,
    format_cpus,
    nvml_topology,
    parse_cpus,
    pcie_matrix,
    worker_cores,
)
from gpu_tasks.errors import DeviceDiscoveryError, ProfileError
from gpu_tasks.policy import (
    best_connected,
    level_index,
    placement_groups,
    set_level,
    unsatisfiable_reason,
    worker_groups,
)
from gpu_tasks.reporting.ledger import Held, Usage
from gpu_tasks.settings import GpuTasksSettings
from gpu_tasks.worker import affinity

GiB = 2**30
PAIRS = "8*H100:80GiB/2s4-nvpairs"


def _addresses(devices) -> list[str]:
    return [d.address for d in devices]


# ------------------------------------------------------------------ emulated shapes
def test_the_two_ready_made_shapes():
    box = emulated_inventory("8*H100:80GiB/nvswitch")
    assert len(box.devices) == 8 and all(d.name == "H100 (emulated)" for d in box.devices)
    wiring = box.wiring
    assert wiring.source == "emulated nvswitch" and wiring.numa == (0, 0, 0, 0, 1, 1, 1, 1)
    assert {wiring.link(a, b) for a, b in itertools.permutations("01234567", 2)} == {"NV18"}
    pairs = emulated_inventory(PAIRS).wiring
    assert pairs.matrix[0] == ("X", "NV4", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS")
    assert pairs.matrix[6] == ("SYS", "SYS", "SYS", "SYS", "NODE", "NODE", "X", "NV4")
    assert pairs.numa == (0, 0, 0, 0, 1, 1, 1, 1)
    plain = emulated_inventory("8/2s4").wiring  # no NVLink: the pairs share a PCIe switch
    assert plain.link("0", "1") == "PIX" and plain.link("1", "2") == "NODE" and plain.link("3", "4") == "SYS"


def test_every_earlier_spec_means_what_it_meant_and_knows_no_wiring():
    for spec in ("4", "H100:80GiB,L4:24GiB", "H100:80GiB@4242:60GiB,L4", "0"):
        inventory = emulated_inventory(spec)
        assert inventory.devices == parse_emulated(spec)
        assert not inventory.wiring.known and "without a shape" in inventory.wiring.source
    assert discover(GpuTasksSettings(emulated_gpus="3")).wiring.known is False
    found = discover(GpuTasksSettings(emulated_gpus="2/nvswitch"))
    assert found.wiring.link("0", "1") == "NV18"


def test_n_star_repeats_an_item():
    devices = parse_emulated("2*H100:80GiB@4242:1GiB,L4:24GiB,3 * A100")
    assert [d.name for d in devices] == ["H100 (emulated)"] * 2 + ["L4 (emulated)"] + ["A100 (emulated)"] * 3
    assert devices[1].emulated_use == ((4242, GiB),) and _addresses(devices) == [str(i) for i in range(6)]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("8/banana", "got shape 'banana'"),
        ("6/2s4-nvpairs", "is 2 x 4 = 8 devices, but the spec gives 6"),
        ("8/2s4-nvtriples", "got shape '2s4-nvtriples'"),
        ("0*H100", "N*ITEM needs N from 1 to 64"),
        ("65*H100", "N*ITEM needs N from 1 to 64"),
        ("2*", "N*ITEM needs N from 1 to 64"),
    ],
)
def test_a_bad_shape_is_refused_listing_the_accepted_forms(spec, says):
    with pytest.raises(DeviceDiscoveryError) as info:
        parse_emulated(spec)
    text = str(info.value)
    assert says in text and text.startswith("GPU_TASKS_EMULATED_GPUS must be")
    if "/" in spec:
        assert "'nvswitch'" in text and "'<S>s<G>'" in text and "-nvpairs" in text


def test_building_a_runner_refuses_a_bad_shape(monkeypatch):
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "8/3s3")
    with pytest.raises(DeviceDiscoveryError, match=r"shape '3s3' is 3 x 3 = 9 devices"):
        ProfileTaskRunner()


# ------------------------------------------------------------------ NVML, on recorded values
def test_nvml_values_map_to_paths_and_cpu_lists():
    # NVML_TOPOLOGY_*: 0 internal, 10 single switch, 20 multiple, 30 host bridge, 40 node, 50 system
    recorded = {(0, 1): 10, (0, 2): 40, (1, 2): 50}
    matrix = pcie_matrix(3, lambda i, j: recorded[(i, j)])
    assert matrix == [["X", "PIX", "NODE"], ["PIX", "X", "SYS"], ["NODE", "SYS", "X"]]
    assert pcie_matrix(2, lambda i, j: 1 / 0) == [["X", "?"], ["?", "X"]]  # a failing call: unknown
    # two devices bridged by 4 links (each end reports them), device 2 with 18 links into an NVSwitch
    bus = ["00000000:17:00.0", "00000000:2A:00.0", "00000000:3D:00.0"]
    remotes = [["00000000:2a:00.0"] * 4, ["0000:17:00.0"] * 4, ["00000000:C1:00.0"] * 18]
    add_nvlinks(matrix, remotes, bus)
    assert matrix[0][1] == matrix[1][0] == "NV4" and matrix[0][2] == "NODE"
    assert cpu_list([0xFFFF, 0]) == "0-15" and cpu_list([0b1011, 1]) == "0-1,3,64" and cpu_list([0]) is None


def _fake_nvml(topology_calls: bool = True) -> SimpleNamespace:
    """A stand-in for pynvml: two devices on one PCIe switch, joined by 2 NVLinks, NUMA node 1."""
    calls = {"shutdown": 0}
    bus = {0: b"00000000:17:00.0", 1: b"00000000:18:00.0"}
    fake = SimpleNamespace(
        calls=calls,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetPciInfo=lambda h: SimpleNamespace(busId=bus[h]),
    )
    if topology_calls:
        fake.NVML_NVLINK_MAX_LINKS = 4
        fake.NVML_FEATURE_ENABLED = 1
        fake.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 10
        fake.nvmlDeviceGetNvLinkState = lambda h, link: 1 if link < 2 else 0
        fake.nvmlDeviceGetNvLinkRemotePciInfo_v2 = lambda h, link: SimpleNamespace(busId=bus[1 - h])
        fake.nvmlDeviceGetNumaNodeId = lambda h: 1
        fake.nvmlDeviceGetCpuAffinity = lambda h, words: [0xFF00] + [0] * (words - 1)
    return fake


def test_nvml_topology_from_a_stand_in_driver(monkeypatch):
    fake = _fake_nvml()
    monkeypatch.setattr(topo._gpu, "load", lambda name: fake)
    wiring = nvml_topology(["0", "1"])
    assert wiring.source == "nvml" and wiring.matrix == (("X", "NV2"), ("NV2", "X"))
    assert wiring.numa == (1, 1) and wiring.cpus == ("8-15", "8-15") and fake.calls["shutdown"] == 1


def test_nvml_without_the_calls_or_a_driver_gives_unknown_wiring_never_an_error(monkeypatch):
    old = _fake_nvml(topology_calls=False)  # an old driver: no topology calls at all
    monkeypatch.setattr(topo._gpu, "load", lambda name: old)
    wiring = nvml_topology(["0", "1"])
    assert wiring.matrix == (("X", "?"), ("?", "X")) and not wiring.known
    assert not nvml_topology(["MIG-1", "MIG-2"]).known  # MIG instances: their parent's wiring
    assert not nvml_topology([]).known

    def missing(name):
        raise topo._gpu.GpuLibraryUnavailable(name, "install the GPU extra")

    monkeypatch.setattr(topo._gpu, "load", missing)
    assert nvml_topology(["0"]).source == "unknown (NVML: GpuLibraryUnavailable)"


# ------------------------------------------------------------------ the choice, pure
def _devices(n: int) -> tuple[Device, ...]:
    return tuple(Device(address=str(i), index=i, name="GPU") for i in range(n))


@st.composite
def hosts(draw):
    """A host as hardware is built: sockets of host bridges of PCIe switches of devices, some
    NVLinks on top, and some paths NVML could not read."""
    n = draw(st.integers(1, 9))
    socket = [draw(st.integers(0, 1)) for _ in range(n)]
    bridge = [draw(st.integers(0, 1)) for _ in range(n)]
    switch = [draw(st.integers(0, 2)) for _ in range(n)]
    nv = {p: draw(st.sampled_from([0, 0, 2, 4, 12])) for p in itertools.combinations(range(n), 2)}
    lost = draw(st.sets(st.sampled_from(list(itertools.combinations(range(n), 2)) or [(0, 0)])))

    def path(i: int, j: int) -> str:
        if i == j:
            return "X"
        p = (min(i, j), max(i, j))
        if p in lost:
            return "?"
        if nv[p]:
            return f"NV{nv[p]}"
        if socket[i] != socket[j]:
            return "SYS"
        if bridge[i] != bridge[j]:
            return "NODE"
        return "PIX" if switch[i] == switch[j] else "PHB"

    numa = tuple(draw(st.sampled_from([s, None])) for s in socket)
    wiring = Topology(
        addresses=tuple(str(i) for i in range(n)),
        matrix=tuple(tuple(path(i, j) for j in range(n)) for i in range(n)),
        numa=numa,
        cpus=(None,) * n,
        source="drawn",
    )
    free = draw(st.lists(st.sampled_from(range(n)), unique=True))
    size = draw(st.integers(1, n))
    return wiring, [_devices(n)[i] for i in sorted(free)], size


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hosts())
def test_the_chosen_set_is_free_of_the_size_and_as_good_as_any(host):
    wiring, free, n = host
    chosen = best_connected(wiring, free, n)
    if n > len(free):
        assert chosen is None
        return
    assert chosen is not None and len(chosen) == n == len(set(chosen)) and set(chosen) <= set(free)
    # as good as any free set of that size: its level first, then its worst path
    every = list(itertools.combinations(_addresses(free), n))
    best_level = min(set_level(wiring, s) for s in every)
    got = _addresses(chosen)
    assert set_level(wiring, got) == best_level
    worst = {
        s: max((topo.level_rank(wiring.link(a, b)) for a, b in itertools.combinations(s, 2)), default=0)
        for s in every
        if set_level(wiring, s) == best_level
    }
    assert worst[tuple(got)] == min(worst.values())
    # a required level: a set that meets it when one exists, else none
    for required in range(len(LEVELS)):
        meets = best_connected(wiring, free, n, at_most=required)
        assert (meets is not None) == (best_level <= required)


def test_unknown_wiring_keeps_todays_order():
    free = list(_devices(6))[1:]
    assert _addresses(best_connected(Topology.unknown([str(i) for i in range(6)]), free, 3)) == [
        "1",
        "2",
        "3",
    ]


def test_one_device_is_taken_where_it_breaks_no_island():
    wiring = emulated_inventory(PAIRS).wiring
    devices = _devices(8)
    # device 1 is busy: 0 has lost its NVLink partner, so a single takes 0 and leaves 2-3 whole
    free = [d for d in devices if d.address != "1"]
    assert _addresses(best_connected(wiring, free, 1)) == ["0"]
    free = [d for d in devices if d.address not in ("1", "0", "2")]  # 3 alone on its switch pair
    assert _addresses(best_connected(wiring, free, 1)) == ["3"]


def test_placement_on_the_shapes():
    devices = _devices(8)
    pairs = emulated_inventory(PAIRS).wiring
    two = ResourceProfile(name="two", gpus=2)
    # every device free: the NVLink pairs, in order
    groups = placement_groups(two, pairs, devices, {d.address for d in devices}, 1)
    assert [_addresses(g) for g in groups] == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    # 1 and 4 busy: the free NVLink pairs first; the groups never overlap
    free = {"0", "2", "3", "5", "6", "7"}
    groups = placement_groups(two, pairs, devices, free, 2)
    assert [_addresses(g) for g in groups[:2]] == [["2", "3"], ["6", "7"]]
    flat = [a for g in groups for a in _addresses(g)]
    assert len(flat) == len(set(flat))
    # a gang of 4 one-device workers with 1 busy: one socket's four, not 3 + 1 across sockets
    gang = ResourceProfile(name="gang", gpus=1, gang=True, max_workers=4)
    groups = placement_groups(gang, pairs, devices, {str(i) for i in range(8)} - {"1"}, 4)
    assert sorted(a for g in groups[:4] for a in _addresses(g)) == ["4", "5", "6", "7"]
    # on an NVSwitch box every set is all-NVLink: today's order
    box = emulated_inventory("8/nvswitch").wiring
    groups = placement_groups(gang, box, devices, {str(i) for i in range(8)} - {"1"}, 4)
    assert [a for g in groups[:4] for a in _addresses(g)] == ["0", "2", "3", "4"]


def test_a_required_level_limits_groups_and_fails_fast_when_no_set_exists():
    inventory = emulated_inventory(PAIRS)
    nv = ResourceProfile(name="nv", gpus=2, topology="nvlink")
    assert [_addresses(g) for g in worker_groups(nv, inventory)] == [
        ["0", "1"],
        ["2", "3"],
        ["4", "5"],
        ["6", "7"],
    ]
    assert unsatisfiable_reason(nv, inventory) is None
    # with 1 busy, only the three free NVLink pairs are candidates
    groups = placement_groups(nv, inventory.wiring, inventory.devices, {"0", "2", "3", "4", "5", "6", "7"}, 1)
    assert [_addresses(g) for g in groups] == [["2", "3"], ["4", "5"], ["6", "7"], ["0", "1"]]
    four = ResourceProfile(name="four", gpus=4, topology="nvlink")
    reason = unsatisfiable_reason(four, inventory)
    assert reason is not None and "requires topology='nvlink'" in reason
    assert "the best set is 0,1,2,3 (socket)" in reason and "lower topology or remove it" in reason
    assert unsatisfiable_reason(ResourceProfile(name="s", gpus=4, topology="socket"), inventory) is None
    gang = ResourceProfile(name="g", gpus=1, gang=True, max_workers=5, topology="socket")
    assert "5 device(s) (a gang of 5 worker(s))" in (unsatisfiable_reason(gang, inventory) or "")
    unknown = Inventory(devices=inventory.devices, source="emulated")
    reason = unsatisfiable_reason(nv, unknown)
    assert reason is not None and "wiring is unknown" in reason and "2s4-nvpairs" in reason
    assert level_index(None) == len(LEVELS) - 1


def test_the_topology_field_is_for_gpu_profiles_only():
    with pytest.raises(ProfileError, match="topology needs gpus > 0"):
        ResourceProfile(name="cpu", topology="nvlink")
    with pytest.raises(ProfileError, match="topology"):
        ResourceProfile(name="p", gpus=2, topology="nvswitch")
    # one device per worker has no pair to wire: it ran on a host without NVLink and failed on one whose
    # wiring is unknown (found by a new-user pass)
    for one in ({"gpus": 1}, {"gpus": 0.5}, {"gpu_memory_per_task": "10GiB"}):
        with pytest.raises(ProfileError, match="needs two or more devices per worker"):
            ResourceProfile(name="p", topology="nvlink", **one)
    assert ResourceProfile(name="g", gpus=1, gang=True, max_workers=2, topology="nvlink").topology == "nvlink"


# ------------------------------------------------------------------ CPU affinity, pure
def test_cpu_lists_read_and_write():
    assert parse_cpus("0-3,8, 10-11") == {0, 1, 2, 3, 8, 10, 11} and parse_cpus("") == frozenset()
    assert format_cpus({11, 0, 1, 2, 3, 8, 10}) == "0-3,8,10-11" and format_cpus([]) == ""
    for bad in ("a", "3-1", "-1"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_a_workers_cores_are_its_devices_cores_it_may_use():
    # the union of its devices' CPUs, within what this process may use
    assert worker_cores(["0-3", "8-11"], range(16)) == (frozenset({0, 1, 2, 3, 8, 9, 10, 11}), "0-3,8-11")
    assert worker_cores(["0-47,96-143"], {1, 2, 100, 200}) == (frozenset({1, 2, 100}), "1-2,100")
    # never an empty set: declared cores this machine lacks, unknown CPUs, no device
    assert worker_cores(["8-15"], {0, 1}) == (None, "not applied: cores 8-15 not available here")
    assert worker_cores(["0-3", None], {0, 1}) == (None, "not applied: the device's CPUs are unknown")
    assert worker_cores([], {0, 1}) == (None, "not applied: no device")


def test_a_shape_may_declare_each_sockets_cores():
    wiring = emulated_inventory("4*H100:80GiB/2s2-nvpairs-c8").wiring
    assert wiring.cpus == ("0-7", "0-7", "8-15", "8-15") and wiring.link("0", "1") == "NV4"
    assert wiring.cpus_of("2") == "8-15" and wiring.cpus_of("9") is None
    assert emulated_inventory("2/2s1-c1").wiring.cpus == ("0", "1")
    assert emulated_inventory("4/nvswitch-c2").wiring.cpus == ("0-1", "0-1", "2-3", "2-3")
    assert emulated_inventory(PAIRS).wiring.cpus == (None,) * 8  # undeclared: unknown, as before
    with pytest.raises(DeviceDiscoveryError, match="-c<C>"):
        parse_emulated("2/2s1-c0")


def test_a_worker_without_known_cpus_is_said_once_at_info_then_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger=affinity.logger.name)
    for _ in range(3):
        assert affinity.plan(True, [None]) == ("", "not applied: the device's CPUs are unknown")
    levels = [r.levelno for r in caplog.records if "CPU affinity not applied" in r.getMessage()]
    assert (
        levels.count(logging.INFO) <= 1 and len(levels) == 3
    )  # at most once (another test may have said it)


def test_the_plan_a_worker_gets_and_dask_cudas_pinning_left_out():
    allowed = os.sched_getaffinity(0)
    mine = format_cpus(allowed)
    assert affinity.plan(True, [mine]) == (mine, mine)
    assert affinity.plan(False, [mine]) == ("", affinity.OFF)
    assert affinity.plan(True, ["4096-4100"]) == ("", "not applied: cores 4096-4100 not available here")
    # dask-cuda's CPUAffinity plugin (matched by name and package: dask-cuda is not installed here)
    from gpu_tasks.compat.dask_cuda import without_cpu_affinity

    theirs = type("CPUAffinity", (), {"__module__": "dask_cuda.plugins"})()
    other = type("RMMSetup", (), {"__module__": "dask_cuda.plugins"})()
    namesake = type("CPUAffinity", (), {"__module__": "someone_else"})()
    assert without_cpu_affinity({theirs, other, namesake}) == {other, namesake}
    assert without_cpu_affinity(None) == set()


def test_the_ledger_records_each_workers_cpus():
    usage = Usage()
    workers = [Held("w0", ("0", "1"), ("H100",) * 2, "0-3"), Held("w1", ("2",), ("H100",), affinity.OFF)]
    usage.held(workers, since=100.0)
    row = usage.row("train", workers, emulated=True, closed=110.0, reason="done")
    assert row.cpu_affinity == ("devices 0,1: 0-3", "devices 2: off (cpu_affinity=False)")
    assert [s.cpus for s in row.spans] == ["0-3", "0-3", affinity.OFF]
    data = row.as_dict()
    assert data["cpu_affinity"] == list(row.cpu_affinity) and data["spans"][2]["cpus"] == affinity.OFF


def test_cpu_affinity_is_a_local_field():
    assert ResourceProfile(name="g", gpus=1).cpu_affinity is True
    assert ResourceProfile(name="g", gpus=1, cpu_affinity=False).cpu_affinity is False
    with pytest.raises(ProfileError, match="cpu_affinity"):
        ResourceProfile(name="a", address="tcp://127.0.0.1:8786", cpu_affinity=False)


# ------------------------------------------------------------------ what a gang ran on, recorded
def test_a_gangs_worst_link_and_a_better_set_that_existed():
    from gpu_tasks.policy import gang_wiring

    inventory = emulated_inventory(PAIRS)
    devices = inventory.devices
    # across sockets while socket 0's four existed (busy or free)
    assert gang_wiring(inventory.wiring, ["2", "3", "4", "5"], devices) == ("SYS", "0,1,2,3 (socket)")
    assert gang_wiring(inventory.wiring, ["0", "1", "2", "3"], devices) == ("NODE", "")
    assert gang_wiring(inventory.wiring, ["0", "1"], devices) == ("NV4", "")
    assert gang_wiring(inventory.wiring, ["0"], devices) == ("", "")
    assert gang_wiring(Topology.unknown(["0", "1"]), ["0", "1"], devices[:2]) == ("", "")


def test_the_ledger_timeline_events_and_advice_record_a_gangs_wiring():
    from gpu_tasks.reporting.artifacts import TABLE_ROW_CHARS, timeline_markdown
    from gpu_tasks.reporting.events import device_payload
    from gpu_tasks.reporting.ledger import right_size

    usage = Usage()
    workers = [Held(f"g-gpu{d}", (d,), ("H100 80 GiB, emulated",), "") for d in "2345"]
    usage.held(workers, since=100.0)
    usage.gang(("2", "3", "4", "5"), "SYS", "0,1,2,3 (socket)")
    row = usage.row("gang", workers, emulated=True, closed=110.0, reason="done")
    assert (row.gang, row.worst_link, row.better_set) == (("2", "3", "4", "5"), "SYS", "0,1,2,3 (socket)")
    data = row.as_dict()
    assert (
        data["gang"] == "2,3,4,5" and data["worst_link"] == "SYS" and data["better_set"] == "0,1,2,3 (socket)"
    )
    [*_, (profile, line, measured)] = right_size([row])
    assert profile == "gang" and measured is None
    assert line == (
        "profile 'gang': its gang ran across sockets (devices 2,3,4,5: SYS) while 0,1,2,3 (socket) "
        "existed; topology='socket' waits for such a set"
    )
    text = timeline_markdown([row]) or ""
    assert "- profile gang: 2,3,4,5, worst SYS; better wired: 0,1,2,3 (socket)" in text and line in text
    table = [t for t in text.splitlines() if t.startswith("|")]
    assert table and max(len(t) for t in table) <= TABLE_ROW_CHARS
    # a gang on one NVLink pair: recorded, no advice
    usage.reset()
    usage.held(workers[:2], since=100.0)
    usage.gang(("0", "1"), "NV4", "")
    pair = usage.row("pair", workers[:2], emulated=True, closed=110.0, reason="done")
    assert pair.worst_link == "NV4" and right_size([pair])[1:] == []
    assert usage.row("w", workers[:1], True, 111.0, "retired", whole=False).gang == ()
    # the lease events carry it
    payload = {"workers": 4, "gang": "2,3,4,5", "worst_link": "SYS"}
    assert device_payload("gang", None, payload) == {
        "profile": "gang",
        "gang": "2,3,4,5",
        "worst_link": "SYS",
    }
    assert device_payload("one", "idle", {"workers": 1}) == {"profile": "one", "reason": "idle"}


# ------------------------------------------------------------------ gpu-tasks devices
def test_devices_shows_the_wiring_matrix_and_its_json(monkeypatch):
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", PAIRS)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("GPU_TASKS_DISCOVERY_COMMAND", raising=False)
    result = CliRunner().invoke(app, ["devices"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Wiring (emulated 2s4-nvpairs)" in out and "NUMA Affinity" in out
    row = next(line for line in out.splitlines() if re.match(r"^\W*GPU0\W", line) and "NV4" in line)
    assert re.findall(r"X|NV4|NODE|SYS", row) == ["X", "NV4", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]
    data = json.loads(CliRunner().invoke(app, ["devices", "--json"]).stdout)
    assert data["topology"]["matrix"]["2"]["3"] == "NV4" and data["topology"]["numa"]["5"] == 1
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "2")
    assert "Wiring: unknown (emulated devices without a shape)" in CliRunner().invoke(app, ["devices"]).stdout


# ------------------------------------------------------------------ in a flow
@task
def _where() -> dict:
    a = current_allocation()
    return {"devices": list(a.devices), "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


@task
def _cpus() -> dict:
    return {"devices": list(current_allocation().devices), "cpus": sorted(os.sched_getaffinity(0))}


@pytest.mark.processes
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable CPU cores (0 and 1)")
@pytest.mark.usefixtures("no_leaked_processes", "lease_dir")
def test_a_worker_runs_on_its_devices_cores_unless_the_profile_says_not(monkeypatch):
    """Two devices, one per socket of one core each (the shape declares device 0 on core 0, device 1
    on core 1): the pinned profile's task runs on its device's core; cpu_affinity=False keeps the
    flow process's CPUs."""
    assert {0, 1} <= os.sched_getaffinity(0)
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "2*H100:80GiB/2s1-c1")
    pinned = ResourceProfile(name="pinned", gpus=1, max_workers=1, idle_timeout=30)
    loose = ResourceProfile(name="loose", gpus=1, max_workers=1, idle_timeout=30, cpu_affinity=False)
    box = []

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="cpu"), pinned, loose], default="cpu"))
    def f():
        from prefect.context import FlowRunContext

        box.append(FlowRunContext.get().task_runner)
        a = _cpus.with_options(tags=[profile_tag("pinned")]).submit()
        b = _cpus.with_options(tags=[profile_tag("loose")]).submit()
        return a.result(), b.result()

    got, kept = f()
    [device] = got["devices"]
    assert got["cpus"] == [int(device)]  # device 0 on core 0, device 1 on core 1
    assert kept["cpus"] == sorted(os.sched_getaffinity(0)) and kept["devices"] != got["devices"]
    rows = {r.profile: r for r in box[0].ledger}
    assert rows["pinned"].cpu_affinity == (f"devices {device}: {device}",)
    assert rows["loose"].cpu_affinity == (f"devices {kept['devices'][0]}: off (cpu_affinity=False)",)


@pytest.mark.processes
@pytest.mark.usefixtures("no_leaked_processes", "lease_dir")
def test_a_two_device_task_gets_an_nvlink_pair(monkeypatch):
    """Device 0 is an L4, 1-7 H100s wired as 2s4-nvpairs: today's consecutive groups of the H100s
    would be 1,2 (NODE); by wiring the worker owns 2,3 (NV4)."""
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "L4:24GiB,7*H100:80GiB/2s4-nvpairs")
    pair = ResourceProfile(name="pair", gpus=2, gpu_model="H100", max_workers=1, idle_timeout=0)
    cpu = ResourceProfile(name="cpu")

    @flow(task_runner=ProfileTaskRunner(profiles=[cpu, pair], default="cpu"))
    def f():
        return _where.with_options(tags=[profile_tag("pair")]).submit().result()

    got = f()
    assert got["visible"] == "2,3" and got["devices"] == ["2", "3"]
