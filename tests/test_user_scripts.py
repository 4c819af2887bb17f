"""Scripts as a user writes them, in fresh processes: the README example, the shipped profiles
file, and a script without the ``__main__`` guard."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

from faults._procs import clean_env, wait_gone

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs(tmp_path: Path, prefect_server):
    import prefect.settings

    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks, "README has a python example"
    example = tmp_path / "example.py"
    example.write_text(blocks[0])
    env = clean_env(
        uuid.uuid4().hex,
        GPU_TASKS_EMULATED_GPUS="2",
        PREFECT_API_URL=str(prefect.settings.PREFECT_API_URL.value()),
    )
    proc = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, env=env, timeout=200
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "'emulated': True" in last and "'n': 1000" in last
    assert re.search(r"'devices': \('\d',?\)", last), last


def test_shipped_profiles_file_loads_and_places_on_emulated_h100s(monkeypatch):
    from gpu_tasks import discover, load_profiles_file
    from gpu_tasks.policy import matching_devices

    profiles, default = load_profiles_file(ROOT / "infra" / "profiles.toml")
    assert default == "cpu" and set(profiles) == {"cpu", "gpu-etl", "gpu-train"}
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "H100:80GiB,L4:24GiB,H100:80GiB")
    inventory = discover()
    assert [d.address for d in matching_devices(profiles["gpu-train"], inventory)] == ["0", "2"]


def test_an_unguarded_script_runs_with_forked_workers_and_fails_clearly_with_spawned_ones(
    tmp_path: Path, prefect_server
):
    """Warm processes forked from the pool's fork server (the default) do not import the script:
    one without the __main__ guard runs. Spawned ones (GPU_TASKS_TUNE_WARM_START=spawn) re-import it
    and cannot start: a clear error, not a hang."""
    import prefect.settings

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from prefect import flow, task\n"
        "from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile\n"
        "@task(tags=[profile('gpu')])\n"
        "def f():\n    return 1\n"
        "@flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name='gpu', gpus=1)]))\n"
        "def p():\n    return f.submit().result()\n"
        "print('result', p())\n"
    )
    for start in ("forkserver", "spawn"):
        marker = uuid.uuid4().hex
        env = clean_env(
            marker,
            GPU_TASKS_EMULATED_GPUS="1",
            GPU_TASKS_TUNE_WARM_START=start,
            # a worker that dies while starting fails the profile at once; this bound is only for a
            # warm process still importing, which a loaded 2-core machine can keep past 10 s
            GPU_TASKS_PROVISION_TIMEOUT="60",
            PREFECT_API_URL=str(prefect.settings.PREFECT_API_URL.value()),
        )
        proc = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=150
        )
        if start == "forkserver":
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert proc.stdout.count("result 1") == 1, proc.stdout  # the flow ran once, in the script
        else:
            assert proc.returncode != 0
            assert "ClusterError: profile 'gpu': could not start 1 worker(s)" in proc.stderr
            assert 'if __name__ == "__main__":' in proc.stderr
        # this script's processes only (an environment marker every descendant inherits): orphaned
        # workers exit when they see their parent gone, within seconds even on a loaded machine
        waited, strays = wait_gone(marker, timeout=10)
        assert not strays, f"worker processes outlived the script by {waited:.1f}s: {strays}"
