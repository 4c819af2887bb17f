"""``GPU_TASKS_*`` settings: a bad value fails in one line naming the variable when a flow module
builds its runner, and a variable that is no setting (a typo) gets one warning naming the closest.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from gpu_tasks import ProfileTaskRunner
from gpu_tasks.errors import DeviceDiscoveryError, SettingsError
from gpu_tasks.settings import get_settings, unknown_variables


def test_a_typo_is_named_with_the_setting_it_resembles():
    lines = unknown_variables({"GPU_TASKS_IDLE_TIMOUT": "5", "GPU_TASKS_IDLE_TIMEOUT": "5", "PATH": "/bin"})
    assert lines == [
        "GPU_TASKS_IDLE_TIMOUT is not a gpu-tasks setting and changes nothing; did you mean "
        "GPU_TASKS_IDLE_TIMEOUT?"
    ]
    far = unknown_variables({"GPU_TASKS_COLOUR": "blue"})
    assert far == [
        "GPU_TASKS_COLOUR is not a gpu-tasks setting and changes nothing; docs/profiles.md lists the settings"
    ]


def test_the_example_and_worker_variables_are_not_reported():
    env = {
        "GPU_TASKS_DATA_DIR": "/data",
        "GPU_TASKS_WORKER_PROFILE": "gpu",
        "GPU_TASKS_PLACEMENT_TAGS_FREE_AT": "1",
        "GPU_TASKS_TEST_WORKERS": "3",
        "GPU_TASKS_LEASE_TIMEOUT": "5",
    }
    assert unknown_variables(env) == []


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("GPU_TASKS_IDLE_TIMEOUT", "-1", "greater than or equal to 0"),
        ("GPU_TASKS_IDLE_TIMEOUT", "soon", "valid number"),
        ("GPU_TASKS_WARM_WORKERS", "many", "valid integer"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable(monkeypatch, var, value, says):
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as info:
        get_settings()
    text = str(info.value)
    assert text.count("\n") == 0 and text.startswith(f"invalid setting {var}={value!r}: ") and says in text


def test_building_a_runner_checks_the_settings(monkeypatch, caplog):
    monkeypatch.setenv("GPU_TASKS_IDLE_TIMEOUT", "-1")
    with pytest.raises(SettingsError, match="GPU_TASKS_IDLE_TIMEOUT='-1'"):
        ProfileTaskRunner()
    monkeypatch.delenv("GPU_TASKS_IDLE_TIMEOUT")
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "banana")
    with pytest.raises(DeviceDiscoveryError, match="neither a whole count nor a model name"):
        ProfileTaskRunner()
    monkeypatch.delenv("GPU_TASKS_EMULATED_GPUS")
    monkeypatch.setenv("GPU_TASKS_PROVISON_TIMEOUT", "5")
    with caplog.at_level(logging.WARNING, logger="gpu_tasks"):
        ProfileTaskRunner()
        ProfileTaskRunner()  # once per process
    said = [r.getMessage() for r in caplog.records if "PROVISON" in r.getMessage()]
    assert said == [
        "gpu-tasks: GPU_TASKS_PROVISON_TIMEOUT is not a gpu-tasks setting and changes nothing; did you mean "
        "GPU_TASKS_PROVISION_TIMEOUT?"
    ]


def _run_flow_script(tmp_path, **env_extra: str) -> list[str]:
    """A plain flow script that builds its runner at import, run as a user runs it; its stderr lines
    (it must fail: exit 1, one traceback, before Prefect starts a temporary server)."""
    script = tmp_path / "flow.py"
    script.write_text(
        "from prefect import flow\n"
        "from gpu_tasks import ProfileTaskRunner\n"
        "@flow(task_runner=ProfileTaskRunner())\n"
        "def f():\n    return 1\n"
        "if __name__ == '__main__':\n    f()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "GPU_TASKS_"))}
    out = subprocess.run(
        [sys.executable, str(script)], env={**env, **env_extra}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.count("Traceback") == 1 and "Starting temporary server" not in out.stderr + out.stdout
    return out.stderr.strip().splitlines()


def test_a_flow_script_with_a_bad_setting_fails_at_import_without_a_server(tmp_path):
    lines = _run_flow_script(tmp_path, GPU_TASKS_IDLE_TIMEOUT="-1")
    assert lines[-1].startswith(
        "gpu_tasks.errors.SettingsError: invalid setting GPU_TASKS_IDLE_TIMEOUT='-1': "
    )


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[profiles.gpu]\ngpus = 0.3\n", "profile 'gpu': gpus must be a whole number or 1/k"),
        ("[profiles.gpu]\ngpus = 1\n\n[profiles.etl\n", "is not valid TOML: "),
        ('default = "small"\n[profiles.gpu]\ngpus = 1\n', "default profile 'small' is not defined"),
    ],
    ids=["bad-field", "bad-toml", "unknown-default"],
)
def test_a_flow_script_with_a_bad_profiles_file_fails_at_import_naming_the_file(tmp_path, text, says):
    path = tmp_path / "profiles.toml"
    path.write_text(text)
    last = _run_flow_script(tmp_path, GPU_TASKS_PROFILES_FILE=str(path))[-1]
    assert last.startswith("gpu_tasks.errors.") and f"profiles file {str(path)!r}" in last and says in last
    if "TOML" in says:
        assert "(at line 4, column" in last
