"""infra/: work-pool job templates for GPU hosts and prefect.yaml deployments, checked
against a real Prefect server and Prefect's own template rendering."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from prefect_api import api, flow_run_events, flow_run_task_runs

ROOT = Path(__file__).resolve().parents[1]
POOLS = ROOT / "infra" / "work-pools"


def _render(template: dict, **values) -> dict:
    """The job configuration a worker would get: variable defaults, overridden by ``values``."""
    from prefect.utilities.templating import apply_values

    defaults = {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}
    return apply_values(template["job_configuration"], {**defaults, **values})


@pytest.mark.parametrize(
    ("file", "pool_type"), [("kubernetes-gpu.json", "kubernetes"), ("docker-gpu.json", "docker")]
)
def test_work_pool_template_is_accepted_and_read_back(prefect_server, file: str, pool_type: str):
    template = json.loads((POOLS / file).read_text())
    name = f"gpu-tasks-{pool_type}-{uuid.uuid4().hex[:6]}"
    code, body = api(
        "POST", "/work_pools/", json={"name": name, "type": pool_type, "base_job_template": template}
    )
    assert code == 201, body
    code, pool = api("GET", f"/work_pools/{name}")
    assert code == 200 and pool["base_job_template"] == template and pool["type"] == pool_type


def test_kubernetes_gpu_count_sets_the_nvidia_limit_and_node_selector():
    template = json.loads((POOLS / "kubernetes-gpu.json").read_text())
    job = _render(template, gpu_count=2, node_selector={"nvidia.com/gpu.product": "NVIDIA-L4"}, name="etl")
    pod = job["job_manifest"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert job["env"]["GPU_TASKS_PROFILES_FILE"], "profiles can be remapped per pool or deployment"
    default = _render(template, name="etl")["job_manifest"]["spec"]["template"]["spec"]
    assert default["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_docker_template_passes_a_gpu_device_request():
    template = json.loads((POOLS / "docker-gpu.json").read_text())
    request = _render(template, gpu_count=2)["container_create_kwargs"]["device_requests"][0]
    assert request["Driver"] == "nvidia" and request["Count"] == 2 and request["Capabilities"] == [["gpu"]]
    by_id = _render(template, gpu_count=0, gpu_device_ids=["1"])["container_create_kwargs"][
        "device_requests"
    ][0]
    assert by_id["DeviceIDs"] == ["1"] and by_id["Count"] == 0


def test_prefect_yaml_deployments_point_at_the_flow_with_valid_schedules_and_parameters():
    from prefect.client.schemas.schedules import construct_schedule
    from prefect.flows import load_flow_from_entrypoint

    from gpu_tasks.deployments import deployment_info

    spec = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())
    assert spec["prefect-version"] == "3.8.8"
    assert len(spec["deployments"]) >= 2
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for dep in spec["deployments"]:
            flow = load_flow_from_entrypoint(dep["entrypoint"])
            assert flow.name == "etl-train"
            flow.validate_parameters(dep["parameters"])
            for schedule in dep["schedules"]:
                construct_schedule(cron=schedule["cron"], timezone=schedule.get("timezone"))
            profiles_file = dep["work_pool"]["job_variables"]["env"].get("GPU_TASKS_PROFILES_FILE")
            if profiles_file:
                from gpu_tasks import load_profiles_file

                assert load_profiles_file(ROOT / profiles_file)[0], profiles_file
            # the description and tags say which profiles and GPUs it needs, as `gpu-tasks deployment-info`
            # prints them for this deployment's profiles file (the header of infra/prefect.yaml says how)
            summary = dep["description"].split(". GPU profiles:")[0]
            info = deployment_info(
                flow, profiles_file=ROOT / profiles_file if profiles_file else None, summary=summary
            )
            assert dep["description"] == info.description, dep["name"]
            assert dep["tags"] == info.tags, dep["name"]
    finally:
        os.chdir(cwd)


def test_prefect_deploy_registers_the_deployments(prefect_server, tmp_path: Path):
    """`prefect deploy --all` with infra/prefect.yaml against the server: both deployments, scheduled."""
    import prefect.settings

    code, body = api("POST", "/work_pools/", json={"name": "gpu-tasks-process", "type": "process"})
    assert code in (201, 409), body
    env = {
        **os.environ,
        "PREFECT_API_URL": str(prefect.settings.PREFECT_API_URL.value()),
        "GPU_TASKS_HOME": str(ROOT),
    }
    prefect_cli = Path(sys.executable).with_name("prefect")

    def prefect(*args: str, cwd: Path = tmp_path, **extra_env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(prefect_cli), *args],
            cwd=cwd,
            env={**env, **extra_env},
            capture_output=True,
            text=True,
            timeout=240,
        )

    proc = prefect("--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml", cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for name, cron in (("nightly", "0 2 * * *"), ("nightly-h100-gang", "30 2 * * *")):
        code, dep = api("GET", f"/deployments/name/etl-train/{name}")
        assert code == 200, dep
        assert [s["schedule"]["cron"] for s in dep["schedules"]] == [cron]
        assert dep["work_pool_name"] == "gpu-tasks-process"
        # the Deployments page shows what it needs
        assert "GPU profiles: gpu-etl: 1 GPU per task" in dep["description"], dep["description"]
        assert "gpu-profile:gpu-train" in dep["tags"] and any(t.startswith("gpus:") for t in dep["tags"])

    # one run of the nightly deployment through a process worker, on emulated devices, at the
    # deployment's GPU_TASKS_PRIORITY; a second one, started with the command docs/leases.md
    # gives, overrides it for that run
    code, dep = api("GET", "/deployments/name/etl-train/nightly")
    assert dep["job_variables"]["env"]["GPU_TASKS_PRIORITY"] == "10", dep["job_variables"]
    params = {"limit": 15000, "num_rounds": 3, "data_dir": str(tmp_path)}
    code, run = api("POST", f"/deployments/{dep['id']}/create_flow_run", json={"parameters": params})
    assert code == 201, run
    urgent = prefect(
        "deployment",
        "run",
        "etl-train/nightly",
        "--params",
        json.dumps(dict(params, data_dir=str(tmp_path / "urgent"))),
        "--job-variable",
        'env={"GPU_TASKS_PRIORITY": "20"}',
    )
    assert urgent.returncode == 0, urgent.stdout[-2000:] + urgent.stderr[-2000:]
    found = re.search(r"UUID: ([0-9a-f-]{36})", urgent.stdout)
    assert found, urgent.stdout
    urgent_run = {"id": found[1]}
    worker = prefect(
        "worker", "start", "--pool", "gpu-tasks-process", "--run-once", GPU_TASKS_EMULATED_GPUS="2"
    )
    code, body = api("GET", f"/flow_runs/{run['id']}")
    assert body["state"]["type"] == "COMPLETED", worker.stdout[-3000:] + worker.stderr[-3000:]
    assert list(tmp_path.glob("scale-1/model/*.metrics.json"))
    code, urgent_body = api("GET", f"/flow_runs/{urgent_run['id']}")
    assert urgent_body["state"]["type"] == "COMPLETED", worker.stdout[-3000:] + worker.stderr[-3000:]
    # the job variable reached each flow run's process: its profiles queued at that priority
    for flow_run_id, priority in ((run["id"], "10"), (urgent_run["id"], "20")):
        [summary] = flow_run_events(flow_run_id, {"name": ["gpu-tasks.flow-run.summary"]})
        labels = summary["resource"]
        assert labels["gpu-tasks.priority"] == priority, labels
        assert labels["gpu-tasks.priorities"] == f"gpu-etl={priority},gpu-train={priority}", labels
    # the flow run carries its deployment's tags; they never route a task (profile: tags do)
    assert "gpus:2" in body["tags"], body["tags"]
    want = {"profile:cpu", "profile:gpu-etl", "profile:gpu-train"}

    def profiles(runs: list) -> set:
        return {t for r in runs for t in r["tags"] if t.startswith("profile:")}

    task_runs = flow_run_task_runs(run["id"], lambda runs: profiles(runs) == want)
    assert task_runs and profiles(task_runs) == want, profiles(task_runs)
    assert not [t for r in task_runs for t in r["tags"] if t.startswith(("gpu-profile:", "gpus:"))]
