"""scripts/gpu-check, the prepared real-GPU check: rehearsed here as a dry run on emulated devices (so
the script is proven before device time is spent), its one-line refusal without a GPU, and docs/gpu.md
as generated from docs/results/gpu.json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from faults._procs import SEEDED_SERVER, seed_prefect_home

from bench.gpu_check import PLAN, render

ROOT = Path(__file__).resolve().parent.parent


def _no_gpu() -> bool:
    return shutil.which("nvidia-smi") is None


@pytest.mark.skipif(not _no_gpu(), reason="this machine has nvidia-smi: the refusal needs a machine without")
def test_without_a_gpu_it_stops_with_one_line():
    out = subprocess.run([str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and "no NVIDIA GPU" in lines[0] and "--dry-run" in lines[0], lines


@pytest.mark.slow
@pytest.mark.timeout(960)  # above the script's own bound (900 s here, --budget)
def test_the_dry_run_runs_every_check_on_emulated_devices(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "GPU_TASKS_"))}
    # this test process's own lease and presence directories (tests/conftest.py), not the host's
    env.update(
        {k: os.environ[k] for k in ("GPU_TASKS_LEASE_DIR", "GPU_TASKS_PRESENCE_DIR") if k in os.environ}
    )
    # a Prefect home of its own (never the user's ~/.prefect), with the database a home has after its
    # first server start: its embedded server otherwise ran every migration (27 s of its 161 s alone)
    home = tmp_path / "prefect-home"
    seed_prefect_home(home)
    # the run's scratch directory (the checks' TMPDIR), under the system's: a deeper one, as this
    # test's tmp_path, makes the fork server's socket path longer than AF_UNIX allows
    before = set(Path(tempfile.gettempdir()).glob("gpu-check-run-*"))
    # every check but the LocalCUDACluster variants: on emulated devices they run the same check on
    # plain Dask workers (the runner builds a LocalCUDACluster for real devices only, with dask-cuda;
    # tests/test_cuda_options.py covers that path with a stand-in), 20 s of this test's 167 in CI
    checks = [p[0] for p in PLAN if not p[0].endswith("_local_cuda_cluster")]
    out = subprocess.run(
        # a loaded 2-core CI machine (tests on three processes: 307-412 s measured) needs more than
        # the GPU machine's 480 s
        [
            *(sys.executable, "-m", "bench.gpu_check", "--dry-run", "--budget", "900", "--only", *checks),
            *("--out-dir", str(tmp_path), "--prefect-home", str(home)),
        ],
        cwd=ROOT,
        env={**env, **SEEDED_SERVER, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
        capture_output=True,
        text=True,
        timeout=930,
    )
    log = (
        (tmp_path / "results" / "gpu-check.log").read_text()[-4000:]
        if (tmp_path / "results").exists()
        else ""
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:] + log
    data = json.loads((tmp_path / "results" / "gpu.json").read_text())
    assert data["device"]["emulated"] is True and data["dry_run"] is True
    assert [c["name"] for c in data["checks"]] == checks and len(checks) == len(PLAN) - 2
    assert data["runs"][-1]["note"] == f"--only {' '.join(checks)}, budget 900 s"  # written after each check
    failed = [c for c in data["checks"] if not c["passed"]]
    assert not failed, failed
    by = {c["name"]: c for c in data["checks"]}
    # the out-of-memory check saw the runner's own error, naming profile and device, then the escalation
    assert "GpuOutOfMemoryError" in by["out_of_memory"]["figures"]["error"]
    assert by["out_of_memory"]["figures"]["escalated"]["profile"] == "whole"
    assert by["leases"]["figures"]["samples_both"] == 0 and all(by["leases"]["figures"]["samples_holding"])
    page = (tmp_path / "gpu.md").read_text()
    assert "DRY RUN on emulated devices" in page and "not GPU results" in page
    assert page == render(data)
    left = set(Path(tempfile.gettempdir()).glob("gpu-check-run-*")) - before
    assert not left, f"the run left its scratch directory: {left}"


def test_docs_gpu_md_is_generated_from_the_committed_results():
    results = ROOT / "docs" / "results" / "gpu.json"
    data = json.loads(results.read_text())
    assert (ROOT / "docs" / "gpu.md").read_text() == render(data), (
        "docs/gpu.md is stale: python -m bench.gpu_check --report-only"
    )
    # committed results come from a real device: a dry run is never committed as GPU results
    assert data["device"]["emulated"] is False and not data.get("dry_run")
    assert {c["name"] for c in data["checks"]} <= {p[0] for p in PLAN}


def test_a_check_kept_from_a_run_on_another_device_names_that_device():
    """``--only`` keeps the other checks' results: the page says which device each ran on, and
    the header does not give the last run's device as every check's."""
    last = {"name": "NVIDIA H100 80GB HBM3", "memory": "79.6 GiB", "emulated": False}
    check = {"passed": True, "figures": {}, "detail": "ok", "commit": "abc1234"}
    data = {
        "device": last,
        "commit": "abc1234",
        "date": "2026-12-05 19:49 UTC",
        "checks": [
            {**check, "name": "inventory", "device": "NVIDIA H200"},
            {**check, "name": "overhead", "device": last["name"]},
        ],
        "runs": [
            {
                "commit": "abc1234",
                "device": "NVIDIA H200",
                "checks": 2,
                "passed": 2,
                "seconds": 9,
                "note": "",
            },
            {"commit": "abc1234", "device": last["name"], "checks": 1, "passed": 1, "seconds": 5, "note": ""},
        ],
    }
    page = render(data)
    assert "some checks below ran on NVIDIA H200" in page
    assert "Passed (commit `abc1234`, NVIDIA H200): ok" in page
    assert f"Passed (commit `abc1234`, {last['name']}): ok" in page
    assert "- `abc1234` on NVIDIA H200: 2 of 2 passed" in page
    data["checks"][0]["device"] = last["name"]  # every check on the last run's device: no such words
    assert "some checks below ran on" not in render(data)


def _synthetic_wheels(d: Path, sizes: dict[str, int]) -> Path:
    import zipfile

    d.mkdir()
    for i, (name, size) in enumerate(sizes.items()):
        dist, version = name, f"1.{i}"
        with zipfile.ZipFile(d / f"{dist}-{version}-py3-none-any.whl", "w") as z:
            z.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {dist}\nVersion: {version}\n")
            z.writestr(f"{dist}/blob.bin", os.urandom(size))  # incompressible: the parts' sizes hold
    return d


def test_parts_split_verify_join_and_a_fresh_machine(tmp_path):
    """The wheels carried in parts (issue 46): split here, each part verified and staged as it arrives
    on the device, a part from an earlier call missing (a fresh machine) said in one line with exit 3,
    a damaged part with exit 4, then joined, checked and the wheels back, byte for byte."""
    from bench import gpu_parts as gp

    wheels = _synthetic_wheels(tmp_path / "wheels", {"alpha": 300_000, "beta": 900_000, "gamma": 50})
    here, device = tmp_path / "here", tmp_path / "device"
    manifest = gp.split(wheels, here / gp.PARTS, 2**19, tree=0)
    parts = manifest["parts"]
    assert len(parts) == 3 and all(p["size"] <= 2**19 for p in parts)
    assert sum(p["size"] for p in parts) == manifest["size"]
    assert not (here / gp.PARTS / gp.ARCHIVE).exists()  # only parts and the manifest travel
    assert [w["name"] for w in manifest["wheels"]] == sorted(p.name for p in wheels.iterdir())

    def carry(n: int, to: Path = device) -> None:
        (to / gp.PARTS).mkdir(parents=True, exist_ok=True)
        for name in (gp.MANIFEST, gp.part_name(n)):
            shutil.copyfile(here / gp.PARTS / name, to / gp.PARTS / name)

    # a call that lands on a fresh machine: part-01 is not there
    carry(2, tmp_path / "fresh")
    with pytest.raises(gp.PartsError) as fresh:
        gp.receive(tmp_path / "fresh", 2)
    assert fresh.value.code == gp.FRESH and len(str(fresh.value).splitlines()) == 1
    assert "part-01 of 3 missing" in str(fresh.value) and "start over from part 1" in str(fresh.value)
    # a part changed on the way is refused and not staged
    carry(1)
    with open(device / gp.PARTS / "part-01", "r+b") as f:
        f.write(b"\0")
    with pytest.raises(gp.PartsError) as damaged:
        gp.receive(device, 1)
    assert damaged.value.code == gp.DAMAGED and not (device / gp.STAGING / "part-01").exists()
    for n in (1, 2, 3):  # back to back: each verified and staged
        carry(n)
        line = gp.receive(device, n)
        assert f"part-0{n} of 3 verified" in line and (device / gp.STAGING / f"part-0{n}").is_file()
    assert "all here" in line
    (device / gp.STAGING / "part-02").rename(tmp_path / "held")
    with pytest.raises(gp.PartsError) as missing:
        gp.assemble(device)
    assert missing.value.code == gp.FRESH and "part-02 of 3 missing" in str(missing.value)
    (tmp_path / "held").rename(device / gp.STAGING / "part-02")
    out, line = gp.assemble(device)
    assert "archive sha256" in line and "3 wheels" in line
    for w in wheels.iterdir():
        assert (out / w.name).read_bytes() == w.read_bytes()
    assert gp.wheel_metadata(out / "beta-1.1-py3-none-any.whl") == "beta 1.1"
    # a later set replaces the staged parts of an earlier one
    gp.split(wheels, here / gp.PARTS, 2**20, tree=0)
    carry(1)
    assert "1 of 2 staged" in gp.receive(device, 1)
    assert not (device / gp.STAGING / "part-03").exists()


def test_parts_size_leaves_room_for_the_tree():
    from bench import gpu_parts as gp

    assert gp.part_size_for(int(3.7 * gp.MiB)) == 58 * gp.MiB  # 64 - 3.7 - 2, whole MiB
    assert gp.tree_bytes(ROOT) > 0
    with pytest.raises(gp.PartsError):
        gp.part_size_for(60 * gp.MiB)
