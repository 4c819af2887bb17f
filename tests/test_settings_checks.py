"""``GPU_TASKS_*`` settings: at most 15 user settings and the tuning knobs (``GPU_TASKS_TUNE_*``),
both tables of docs/profiles.md generated from the model; a bad value fails in one line naming the
variable when a flow module builds its runner (and in the CLI); a variable that is no setting (a
typo) gets one warning naming the closest, an old tuning name one naming its new name; the
runner's internal ``_GPU_TASKS_*`` variables are never reported.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
from pydantic.fields import FieldInfo
from typer.testing import CliRunner

from gpu_tasks import ProfileTaskRunner, allocation
from gpu_tasks.cli import app
from gpu_tasks.errors import DeviceDiscoveryError, SettingsError
from gpu_tasks.settings import (
    INTERNAL_PREFIX,
    PREFIX,
    TUNE_PREFIX,
    GpuTasksSettings,
    _extra,
    get_settings,
    is_tuning,
    old_names,
    variable,
    variable_warnings,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "profiles.md"


def settings_table(tuning: bool) -> str:
    """The user settings (or the tuning knobs) as the Markdown table docs/profiles.md shows."""
    rows = ["| variable | default | takes | what it changes |", "|---|---|---|---|"]
    for field, info in GpuTasksSettings.model_fields.items():
        if is_tuning(field) != tuning:
            continue
        doc = _extra(info)
        text = str(info.description) + (f" ([more]({doc['see']}))" if "see" in doc else "")
        shown = _shown(info, doc)
        shown = shown if shown == "unset" else f"`{shown}`"
        rows.append(f"| `{variable(field)}` | {shown} | {_takes(info, doc)} | {text} |")
    return "\n".join(rows)


def _shown(info: FieldInfo, doc: dict[str, Any]) -> str:
    if "shown" in doc:
        return str(doc["shown"])
    value = info.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def _takes(info: FieldInfo, doc: dict[str, Any]) -> str:
    if "takes" in doc:
        return str(doc["takes"])
    if get_origin(info.annotation) is Literal:
        return " or ".join(str(a) for a in get_args(info.annotation))
    kind: Any = next((a for a in get_args(info.annotation) if a is not type(None)), info.annotation)
    words = {float: "number", int: "integer", bool: "true or false"}.get(kind, "text")
    bounds = [f">= {m.ge:g}" for m in info.metadata if hasattr(m, "ge")]
    bounds += [f"> {m.gt:g}" for m in info.metadata if hasattr(m, "gt")]
    return ", ".join([words, *bounds])


USER = [f for f in GpuTasksSettings.model_fields if not is_tuning(f)]
TUNING = [f for f in GpuTasksSettings.model_fields if is_tuning(f)]


def test_a_typo_is_named_with_the_setting_it_resembles():
    lines = variable_warnings({"GPU_TASKS_IDLE_TIMOUT": "5", "GPU_TASKS_IDLE_TIMEOUT": "5", "PATH": "/bin"})
    assert lines == [
        "GPU_TASKS_IDLE_TIMOUT is not a gpu-tasks setting and changes nothing; did you mean "
        "GPU_TASKS_IDLE_TIMEOUT?"
    ]
    far = variable_warnings({"GPU_TASKS_COLOUR": "blue"})
    assert far == [
        "GPU_TASKS_COLOUR is not a gpu-tasks setting and changes nothing; docs/profiles.md lists the settings"
    ]


def test_the_example_script_and_internal_variables_are_not_reported():
    env = {
        "GPU_TASKS_DATA_DIR": "/data",
        "_GPU_TASKS_WORKER_PROFILE": "gpu",
        "_GPU_TASKS_PLACEMENT_TAGS_FREE_AT": "1",
        "GPU_TASKS_TEST_WORKERS": "3",
        "GPU_TASKS_LEASE_TIMEOUT": "5",
    }
    assert variable_warnings(env) == []


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("GPU_TASKS_IDLE_TIMEOUT", "-1", "greater than or equal to 0"),
        ("GPU_TASKS_IDLE_TIMEOUT", "soon", "valid number"),
        ("GPU_TASKS_PROVISION_TIMEOUT", "inf", "finite number"),  # an endless wait failed every start
        ("GPU_TASKS_TUNE_WARM_WORKERS", "many", "valid integer"),
        ("GPU_TASKS_TUNE_WARM_START", "thread", "'forkserver' or 'spawn'"),
        ("GPU_TASKS_TUNE_QUOTA_LEASE_SECONDS", "5", "greater than or equal to 60"),
        ("GPU_TASKS_OTHER_PROGRAMS_MEMORY", "lots", "must be a size such as 1GiB"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable(monkeypatch, var, value, says):
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as info:
        get_settings()
    text = str(info.value)
    assert text.count("\n") == 0 and text.startswith(f"invalid setting {var}={value!r}: ") and says in text


def test_no_float_setting_takes_inf_or_nan(monkeypatch):
    """Each waits or compares with its value; none means 'forever' by inf (0 is 'never' where one can)."""
    floats = [f for f, info in GpuTasksSettings.model_fields.items() if info.annotation is float]
    assert "lease_timeout" in floats and "idle_timeout" in floats
    for field in floats:
        var = variable(field)
        for value in ("inf", "nan"):
            monkeypatch.setenv(var, value)
            with pytest.raises(SettingsError, match="finite number"):
                get_settings()
        monkeypatch.delenv(var)


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


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("GPU_TASKS_IDLE_TIMEOUT", "-1", ""),
        ("GPU_TASKS_TUNE_WARM_START", "thread", ""),
        ("GPU_TASKS_EVENTS_DRAIN_SECONDS", "-1", " (old name of GPU_TASKS_TUNE_EVENTS_DRAIN_SECONDS)"),
    ],
)
def test_a_flow_script_with_a_bad_setting_fails_at_import_without_a_server(tmp_path, var, value, says):
    lines = _run_flow_script(tmp_path, **{var: value})
    assert lines[-1].startswith(f"gpu_tasks.errors.SettingsError: invalid setting {var}={value!r}{says}: ")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[profiles.gpu]\ngpus = 0.3\n", ", line 2: profile 'gpu': gpus must be a whole number or 1/k"),
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


# ------------------------------------------------------------------ the three kinds of variable
def test_there_are_at_most_15_user_settings():
    # a 16th user setting means moving one to the tuning knobs (or out): the first table of
    # docs/profiles.md is meant to be read through
    assert len(USER) <= 15, f"{len(USER)} user settings: {USER}"
    assert all(variable(f) == PREFIX + f.upper() for f in USER)
    assert all(variable(f) == TUNE_PREFIX + f.upper() for f in TUNING)


def _generated(kind: str) -> str:
    text = DOCS.read_text()
    found = re.search(rf"<!-- {kind}: generated[^\n]*-->\n(.*?)\n<!-- end of {kind} -->", text, re.S)
    assert found, f"docs/profiles.md lost its markers for the {kind} table"
    return found.group(1)


@pytest.mark.parametrize(("kind", "tuning"), [("user settings", False), ("tuning knobs", True)])
def test_the_docs_tables_are_the_settings_model(kind, tuning):
    table = settings_table(tuning=tuning)
    assert _generated(kind) == table, f"docs/profiles.md's {kind} table is stale; paste:\n{table}"
    rows = table.splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == [variable(f) for f in (TUNING if tuning else USER)]
    assert all(row.count(" | ") == 3 and not row.split(" | ")[3].startswith(" ") for row in rows)
    assert INTERNAL_PREFIX not in table and "GPU_TASKS_DATA_DIR" not in table


def test_the_runners_worker_variables_are_internal():
    names = [v for k, v in vars(allocation).items() if k.startswith(("WORKER_ENV_", "PLACEMENT_"))]
    assert len(names) == 6 and all(n.startswith(INTERNAL_PREFIX) for n in names), names
    assert variable_warnings(dict.fromkeys(names, "1")) == []
    before = get_settings()
    with pytest.MonkeyPatch.context() as mp:  # one set by hand changes no setting
        for name in names:
            mp.setenv(name, "many")
        assert get_settings() == before


def test_an_old_tuning_name_still_works_and_names_its_new_name(monkeypatch):
    monkeypatch.setenv("GPU_TASKS_WARM_WORKERS", "0")
    monkeypatch.setenv("GPU_TASKS_PRIORITY_AGING", "5")
    settings = get_settings()
    assert settings.warm_workers == 0 and settings.priority_aging == 5
    assert variable_warnings({"GPU_TASKS_WARM_WORKERS": "0"}) == [
        "GPU_TASKS_WARM_WORKERS is an old name: rename it GPU_TASKS_TUNE_WARM_WORKERS (the old name still "
        "works for now)"
    ]
    monkeypatch.setenv("GPU_TASKS_TUNE_WARM_WORKERS", "3")  # both: the new name counts
    assert get_settings().warm_workers == 3
    assert variable_warnings({"GPU_TASKS_WARM_WORKERS": "0", "GPU_TASKS_TUNE_WARM_WORKERS": "3"}) == [
        "GPU_TASKS_WARM_WORKERS is ignored: GPU_TASKS_TUNE_WARM_WORKERS, its new name, is set too; remove "
        "GPU_TASKS_WARM_WORKERS"
    ]


@pytest.mark.parametrize("field", TUNING)
def test_every_tuning_knob_reads_its_new_and_its_old_name(monkeypatch, field):
    info = GpuTasksSettings.model_fields[field]
    value = 7 if info.annotation in (int, float) else ("spawn" if field == "warm_start" else "DEBUG")
    if field == "quota_lease_seconds":
        value = 90
    assert old_names()[PREFIX + field.upper()] == variable(field)
    for name in (variable(field), PREFIX + field.upper()):
        monkeypatch.setenv(name, str(value))
        assert getattr(get_settings(), field) == value, name
        monkeypatch.delenv(name)


def test_a_bad_value_under_an_old_name_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv("GPU_TASKS_WARM_WORKERS", "many")
    with pytest.raises(SettingsError) as info:
        get_settings()
    assert str(info.value).startswith(
        "invalid setting GPU_TASKS_WARM_WORKERS='many' (old name of GPU_TASKS_TUNE_WARM_WORKERS): "
        "Input should be a valid integer"
    )
    assert "\n" not in str(info.value)


def test_two_bad_values_are_two_lines(monkeypatch):
    monkeypatch.setenv("GPU_TASKS_IDLE_TIMEOUT", "soon")
    monkeypatch.setenv("GPU_TASKS_TUNE_EVENTS_DRAIN_SECONDS", "-3")
    with pytest.raises(SettingsError) as info:
        get_settings()
    lines = str(info.value).splitlines()
    assert [line.split("=")[0] for line in lines] == [
        "invalid setting GPU_TASKS_IDLE_TIMEOUT",
        "invalid setting GPU_TASKS_TUNE_EVENTS_DRAIN_SECONDS",
    ]


def test_the_runner_warns_once_of_an_old_name(monkeypatch, caplog):
    monkeypatch.setenv("GPU_TASKS_EVENTS_DRAIN_SECONDS", "5")
    with caplog.at_level(logging.WARNING, logger="gpu_tasks"):
        ProfileTaskRunner()
        ProfileTaskRunner()  # once per process
    said = [r.getMessage() for r in caplog.records if "EVENTS_DRAIN" in r.getMessage()]
    assert said == [
        "gpu-tasks: GPU_TASKS_EVENTS_DRAIN_SECONDS is an old name: rename it "
        "GPU_TASKS_TUNE_EVENTS_DRAIN_SECONDS (the old name still works for now)"
    ]


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"GPU_TASKS_TUNE_WARM_START": "thread"}, "invalid setting GPU_TASKS_TUNE_WARM_START='thread': "),
        ({"GPU_TASKS_WARM_WORKERS": "x"}, "invalid setting GPU_TASKS_WARM_WORKERS='x' (old name of "),
        ({"GPU_TASKS_IDLE_TIMEOUT": "-1"}, "invalid setting GPU_TASKS_IDLE_TIMEOUT='-1': "),
    ],
)
def test_the_cli_says_a_bad_value_in_one_line(monkeypatch, env, says):
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "2")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["devices"])
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: " + says)


def test_the_cli_warns_of_an_old_name_and_a_typo(monkeypatch):
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "2")
    monkeypatch.setenv("GPU_TASKS_DASK_LOG_LEVEL", "info")
    monkeypatch.setenv("GPU_TASKS_TUNE_WARM_WORKRS", "1")
    result = CliRunner().invoke(app, ["devices"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "warning: GPU_TASKS_DASK_LOG_LEVEL is an old name: rename it GPU_TASKS_TUNE_DASK_LOG_LEVEL (the old "
        "name still works for now)",
        "warning: GPU_TASKS_TUNE_WARM_WORKRS is not a gpu-tasks setting and changes nothing; did you mean "
        "GPU_TASKS_TUNE_WARM_WORKERS?",
    ]


def test_the_default_presence_directory_is_host_wide_whatever_tmpdir_says(tmp_path, monkeypatch):
    """Two users with a ``TMPDIR`` each (pam_tmpdir, a batch job's) had a presence directory each, and
    their tasks ran on one device at once, unseen (a new-user pass); the per-user lease directory
    still follows ``TMPDIR``."""
    import tempfile

    monkeypatch.delenv("GPU_TASKS_PRESENCE_DIR", raising=False)
    monkeypatch.delenv("GPU_TASKS_LEASE_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    settings = get_settings()
    assert settings.presence_dir == Path("/tmp/gpu-tasks-presence")
    assert settings.lease_dir == tmp_path / f"gpu-tasks-leases-{os.getuid()}"
