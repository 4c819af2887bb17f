"""ProfileTaskRunner's own rules: constructor checks, the default profile, profiles from
GPU_TASKS_PROFILES_FILE against those in code, profile tags, and which idle timeout applies.

docs/profiles.md ("Profiles from a TOML file", the tag rules) and docs/runner.md say what
is promised; tests/test_cli.py checks the CLI's copy of these rules, this module the runner's.
Most flows here use CPU profiles (threads in the flow process), so no worker process starts.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from prefect import flow, tags, task
from prefect.context import FlowRunContext

from gpu_tasks import (
    ProfileError,
    ProfileTaskRunner,
    ResourceProfile,
    UnknownProfileError,
    current_allocation,
    profile,
    use_profile,
)

pytestmark = pytest.mark.usefixtures("emulated")

CPU = ResourceProfile(name="cpu", cpus=0.5)
GPU = ResourceProfile(name="gpu", gpus=1, max_workers=1, idle_timeout=30)


@task
def where() -> dict:
    a = current_allocation()
    return {"profile": a.profile, "pid": os.getpid()}


def _runner() -> ProfileTaskRunner:
    return FlowRunContext.get().task_runner


def _write(tmp_path: Path, monkeypatch, text: str) -> Path:
    path = tmp_path / "profiles.toml"
    path.write_text(text)
    monkeypatch.setenv("GPU_TASKS_PROFILES_FILE", str(path))
    return path


# ------------------------------------------------------------------ constructor
def test_profile_names_must_be_distinct():
    with pytest.raises(ProfileError, match=r"distinct names; gpu given more than once"):
        ProfileTaskRunner(profiles=[CPU, GPU, ResourceProfile(name="gpu", gpus=0.5)])


@pytest.mark.parametrize("bad", [{"name": "gpu", "gpus": 1}, "gpu", None])
def test_profiles_must_be_resource_profiles(bad):
    with pytest.raises(ProfileError, match="profiles must be ResourceProfile objects"):
        ProfileTaskRunner(profiles=[CPU, bad])


def test_negative_idle_timeout_is_refused():
    with pytest.raises(ProfileError, match=r"idle_timeout must be >= 0 seconds; got -1"):
        ProfileTaskRunner(profiles=[CPU], idle_timeout=-1)


# ------------------------------------------------------------------ the default profile
def test_cpu_default_is_added_when_nothing_defines_it():
    profiles, default = ProfileTaskRunner(profiles=[GPU]).resolve_profiles()
    assert default == "cpu" and set(profiles) == {"cpu", "gpu"}
    assert profiles["cpu"] == ResourceProfile(name="cpu"), "a plain CPU profile, every field at its default"


@pytest.mark.usefixtures("no_leaked_processes")
def test_untagged_tasks_run_on_the_added_cpu_profile_in_the_flow_process():
    @flow(task_runner=ProfileTaskRunner(profiles=[GPU]))
    def f():
        return where.submit().result(), _runner().status()

    row, status = f()
    assert row == {"profile": "cpu", "pid": os.getpid()}
    assert status["cpu"]["state"] == "running" and status["gpu"]["state"] == "absent"


def test_an_undefined_default_other_than_cpu_is_an_error_naming_it_and_the_known_profiles():
    """It fails where the runner is built: at the import of a flow module that builds it."""
    with pytest.raises(
        UnknownProfileError, match=r"default profile 'small' is not defined; known profiles: cpu, gpu"
    ):
        ProfileTaskRunner(profiles=[CPU, GPU], default="small")


@pytest.mark.usefixtures("no_leaked_processes")
@pytest.mark.parametrize(
    "breaks, error",
    [
        ("file", "default profile 'small' is not defined"),
        ("value", r"profiles file '.*', line 3: profile 'small'"),
        ("setting", "GPU_TASKS_IDLE_TIMEOUT"),
    ],
)
def test_a_file_or_setting_that_breaks_after_the_runner_was_built_fails_the_next_flow_run(
    tmp_path, monkeypatch, prefect_server, breaks, error
):
    """The file and settings are read again for each flow run (a deployment may set them): one broken
    since fails that run at its first task, naming it, and the server records the run Failed. Before,
    Prefect's copy of the runner raised as the run started, outside Prefect's error handling: the
    caller got the error and the run stayed Running for good (a new-user pass, Prefect 3.9.1)."""
    from prefect.client.orchestration import get_client

    path = _write(tmp_path, monkeypatch, 'default = "small"\n[profiles.small]\ncpus = 0.5\n')
    runner = ProfileTaskRunner(profiles=[CPU])
    if breaks == "file":
        path.write_text('default = "small"\n[profiles.big]\ncpus = 1\n')
    elif breaks == "value":
        path.write_text('default = "small"\n[profiles.small]\ncpus = -1\n')
    else:
        monkeypatch.setenv("GPU_TASKS_IDLE_TIMEOUT", "-1")
    ran: list[str] = []

    @flow(task_runner=runner)
    def f():
        ran.append("body")
        return where.submit().result()

    state = f(return_state=True)
    assert state.is_failed() and re.search(error, state.message or ""), state
    assert ran == ["body"]
    with get_client(sync_client=True) as client:
        recorded = client.read_flow_run(state.state_details.flow_run_id).state
    assert recorded is not None and recorded.is_failed(), recorded


def test_the_default_must_be_a_cpu_profile():
    with pytest.raises(ProfileError, match=r"default profile 'gpu' must be a CPU profile \(gpus=0\)"):
        ProfileTaskRunner(profiles=[CPU, GPU], default="gpu").resolve_profiles()


def test_on_oom_must_name_a_profile_the_runner_knows():
    small = ResourceProfile(name="small", gpus=0.5, on_oom="large")
    with pytest.raises(
        UnknownProfileError, match=r"profile 'small' sets on_oom='large'.*known profiles: cpu, small"
    ):
        ProfileTaskRunner(profiles=[CPU, small]).resolve_profiles()


# ------------------------------------------------------------------ profiles file vs code
def test_a_file_profile_replaces_the_code_profile_of_that_name_as_a_whole(tmp_path, monkeypatch):
    _write(tmp_path, monkeypatch, "[profiles.gpu]\ngpus = 0.5\n[profiles.etl]\ncpus = 2\n")
    profiles, default = ProfileTaskRunner(profiles=[CPU, GPU]).resolve_profiles()
    assert set(profiles) == {"cpu", "gpu", "etl"} and default == "cpu"
    assert profiles["gpu"] == ResourceProfile(name="gpu", gpus=0.5), (
        "fields are not merged with the code profile"
    )
    assert profiles["cpu"] == CPU, "profiles the file does not name stay as in code"


@pytest.mark.parametrize(
    "arg, file_default, want",
    [(None, "small", "small"), ("cpu", "small", "cpu"), (None, None, "cpu")],
    ids=["file-default", "argument-beats-file", "cpu-otherwise"],
)
def test_which_profile_is_the_default(tmp_path, monkeypatch, arg, file_default, want):
    top = f'default = "{file_default}"\n' if file_default else ""
    _write(tmp_path, monkeypatch, top + "[profiles.small]\ncpus = 0.5\n")
    assert ProfileTaskRunner(profiles=[CPU], default=arg).resolve_profiles()[1] == want


def test_a_gpu_default_from_the_file_is_an_error(tmp_path, monkeypatch):
    _write(tmp_path, monkeypatch, 'default = "gpu"\n[profiles.gpu]\ngpus = 1\n')
    with pytest.raises(ProfileError, match="default profile 'gpu' must be a CPU profile"):
        ProfileTaskRunner(profiles=[CPU]).resolve_profiles()


@pytest.mark.usefixtures("no_leaked_processes")
def test_the_file_is_read_again_for_each_flow_run(tmp_path, monkeypatch):
    path = _write(tmp_path, monkeypatch, 'default = "small"\n[profiles.small]\ncpus = 0.5\n')
    runner = ProfileTaskRunner(profiles=[CPU])

    @flow(task_runner=runner)
    def f():
        return where.submit().result()["profile"], sorted(_runner().status())

    first = f()
    path.write_text('default = "big"\n[profiles.big]\ncpus = 1\n')
    second = f()
    assert first == ("small", ["cpu", "small"])
    assert second == ("big", ["big", "cpu"])


# ------------------------------------------------------------------ profile tags
TWO = [CPU, ResourceProfile(name="a", cpus=0.5), ResourceProfile(name="b", cpus=0.5)]


@pytest.mark.usefixtures("no_leaked_processes")
@pytest.mark.parametrize("how", ["own-tags", "blocks"])
def test_two_different_profile_tags_fail_at_submit_naming_both(how):
    @flow(task_runner=ProfileTaskRunner(profiles=TWO))
    def f():
        try:
            if how == "own-tags":
                where.with_options(tags=[profile("a"), profile("b")]).submit()
            else:
                with use_profile("a"), use_profile("b"):
                    where.submit()
        except ProfileError as exc:
            return type(exc), str(exc), _runner().status()
        return None

    out = f()
    assert out is not None, "submit must raise"
    kind, message, status = out
    assert kind is ProfileError
    assert "several profiles (a, b)" in message
    fix = "keep exactly one profile:<name> tag" if how == "own-tags" else "its own profile tag, which wins"
    assert fix in message, message
    assert "task 'where'" in message, message
    assert status["a"]["state"] == status["b"]["state"] == "absent", "nothing ran on either profile"


@pytest.mark.usefixtures("no_leaked_processes")
def test_a_bare_profile_tag_fails_at_submit_instead_of_running_on_the_default():
    @flow(task_runner=ProfileTaskRunner(profiles=TWO))
    def f():
        try:
            return where.with_options(tags=["profile:"]).submit().result()
        except UnknownProfileError as exc:
            return str(exc)

    message = f()
    assert isinstance(message, str), f"ran on {message}"
    assert message.startswith("task 'where' carries the tag 'profile:', which names no profile"), message


@pytest.mark.usefixtures("no_leaked_processes")
def test_an_unknown_profile_tag_names_the_profile_it_nearly_names():
    """``profile:big`` or ``profile: Big`` where only ``Big`` is defined: did you mean 'Big'?, never
    the fix ``ResourceProfile(name=' Big', ...)``, an invalid name."""
    big = ResourceProfile(name="Big", cpus=0.5)

    @flow(task_runner=ProfileTaskRunner(profiles=[CPU, big]))
    def f(tag: str) -> str:
        try:
            return str(where.with_options(tags=[tag]).submit().result())
        except UnknownProfileError as exc:
            return str(exc)

    for tag, asked in (("profile:big", "'big'"), ("profile: Big", "' Big'")):
        message = f(tag)
        assert message.startswith(f"task 'where' asks for profile {asked}, which this runner does not know")
        assert message.endswith(
            "known profiles: Big, cpu. Did you mean 'Big'? Tag the task profile:Big "
            "(names are case-sensitive)"
        ), message


@task(tags=[profile("a")])
def nested_parent() -> dict:
    """On profile a's worker: its child's own tag (a) wins over the block naming b around its
    submit, as in the flow; an untagged child there is inside blocks naming two profiles (its
    parent's, a, and b) and fails with the fix."""
    with use_profile("b"):
        child = where.with_options(tags=[profile("a")]).submit().result()
        try:
            where.submit().result()
        except ProfileError as exc:
            return {"child": child["profile"], "untagged": str(exc)}
    return {"child": child["profile"], "untagged": None}


@pytest.mark.usefixtures("no_leaked_processes")
def test_a_tasks_own_profile_tag_wins_over_blocks_in_the_flow_and_in_nested_submits():
    """One rule for the flow and for a task submitted by a task: the task's own profile tag wins;
    without one, the blocks around the submit (use_profile, prefect.tags) name the profile."""

    @flow(task_runner=ProfileTaskRunner(profiles=TWO))
    def f():
        with use_profile("b"):
            own = where.with_options(tags=[profile("a")]).submit().result()
            block = where.submit().result()
        with tags(profile("b")):
            own_in_tags = where.with_options(tags=[profile("a")]).submit().result()
        return own["profile"], block["profile"], own_in_tags["profile"], nested_parent.submit().result()

    own, block, own_in_tags, nested = f()
    assert (own, block, own_in_tags) == ("a", "b", "a")
    assert nested["child"] == "a", nested
    assert nested["untagged"] is not None, nested
    assert "naming several profiles (a, b)" in nested["untagged"], nested
    assert "its own profile tag, which wins" in nested["untagged"], nested


@pytest.mark.usefixtures("no_leaked_processes")
def test_the_same_profile_tag_twice_is_allowed():
    @flow(task_runner=ProfileTaskRunner(profiles=TWO))
    def f():
        with use_profile("a"):
            return where.with_options(tags=[profile("a")]).submit().result()

    assert f()["profile"] == "a"


# ------------------------------------------------------------------ which idle timeout applies
def _closed_reasons(names: list[str]) -> dict[str, str]:
    """Submit one task per profile, wait until each cluster closed idle, return the close reasons."""
    for name in names:
        where.with_options(tags=[profile(name)]).submit().result()
    deadline = time.monotonic() + 60
    # closed, and its ledger row written (the row comes a moment after the state)
    while {s["state"] for n, s in _runner().status().items() if n in names} != {"closed"} or not set(
        names
    ) <= {row.profile for row in _runner().ledger}:
        assert time.monotonic() < deadline, f"not closed within 60 s: {_runner().status()}"
        time.sleep(0.05)
    return {row.profile: row.reason for row in _runner().ledger if row.profile in names}


@pytest.mark.usefixtures("no_leaked_processes")
def test_idle_timeout_profile_field_then_runner_argument(monkeypatch):
    monkeypatch.setenv("GPU_TASKS_IDLE_TIMEOUT", "30")
    own = ResourceProfile(name="own", cpus=0.5, idle_timeout=0.3)
    inherits = ResourceProfile(name="inherits", cpus=0.5)

    @flow(task_runner=ProfileTaskRunner(profiles=[CPU, own, inherits], idle_timeout=0.4))
    def f():
        return _closed_reasons(["own", "inherits"])

    reasons = f()
    assert "(idle_timeout=0.3s)" in reasons["own"], reasons
    assert "(idle_timeout=0.4s)" in reasons["inherits"], reasons


@pytest.mark.usefixtures("no_leaked_processes")
def test_idle_timeout_setting_applies_without_profile_field_or_argument(monkeypatch):
    monkeypatch.setenv("GPU_TASKS_IDLE_TIMEOUT", "0.5")
    inherits = ResourceProfile(name="inherits", cpus=0.5)

    @flow(task_runner=ProfileTaskRunner(profiles=[CPU, inherits]))
    def f():
        return _closed_reasons(["inherits"])

    assert "(idle_timeout=0.5s)" in f()["inherits"]


def test_idle_timeout_default_is_60_seconds(monkeypatch):
    monkeypatch.delenv("GPU_TASKS_IDLE_TIMEOUT", raising=False)
    assert ProfileTaskRunner(profiles=[CPU]).idle_timeout == 60.0
    monkeypatch.setenv("GPU_TASKS_IDLE_TIMEOUT", "7")
    assert ProfileTaskRunner(profiles=[CPU]).idle_timeout == 7.0
    assert ProfileTaskRunner(profiles=[CPU], idle_timeout=0).idle_timeout == 0, (
        "0 is an argument, not 'unset'"
    )


def test_dask_config_shared_by_profiles_starting_at_once_holds_until_the_last_leaves():
    """Two profiles' threads start clusters at once, each inside the non-daemon setting: whichever
    leaves first, the other's start still sees it; after both, Dask's value is back."""
    import threading

    import dask
    import distributed  # noqa: F401  (its config defaults)

    from gpu_tasks.cluster.backends import shared_config

    key = "distributed.worker.daemon"
    before = dask.config.get(key)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def a() -> None:
        with shared_config(key, False):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b() -> None:
        a_in.wait(10)
        with shared_config(key, False):
            b_in.set()
            a_out.wait(10)
            seen["b after a left"] = dask.config.get(key)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"b after a left": False}
    assert dask.config.get(key) == before
