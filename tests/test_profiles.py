"""Resource profiles: validation, tag helpers, Prefect tag propagation, TOML files, settings."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gpu_tasks.errors import ProfileError, SettingsError, UnknownProfileError
from gpu_tasks.profiles import (
    MAX_SHARE,
    ResourceProfile,
    load_profiles_file,
    profile,
    profile_from_tags,
    profiles_from_mapping,
    requested_profile,
    resolve_profiles,
    use_profile,
)
from gpu_tasks.settings import GpuTasksSettings, get_settings, resolve

NAMES = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.\-]{0,20}\Z")
FAST = settings(max_examples=150, deadline=None)


def _is_valid_gpus(value: float) -> bool:
    """Independent oracle, away from the float tolerance band the strategy avoids."""
    if value == 0 or (value >= 1 and float(value).is_integer()):
        return True
    return any(value == 1 / k for k in range(2, MAX_SHARE + 1))


def _near_a_share(value: float) -> bool:
    return any(math.isclose(value, 1 / k, rel_tol=1e-6) for k in range(1, MAX_SHARE + 1))


# ------------------------------------------------------------------ gpus
@FAST
@given(
    name=NAMES,
    value=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.fractions(min_value=Fraction(-100), max_value=Fraction(100)).map(float),
        st.integers(min_value=-(2**40), max_value=-1).map(float),
    ).filter(lambda v: not (math.isfinite(v) and (_is_valid_gpus(v) or _near_a_share(v)))),
)
@example(name="0", value=2.2250738585e-313)  # a subnormal: 1/value overflowed
def test_invalid_gpus_fail_naming_profile_field_and_value(name, value):
    with pytest.raises(ProfileError) as info:
        ResourceProfile(name=name, gpus=value)
    msg = str(info.value)
    assert f"profile {name!r}" in msg
    assert "gpus" in msg
    assert repr(value) in msg


@pytest.mark.parametrize(
    "value", [0.3, 0.6, 1.5, 2.25, -1.0, 1 / 65, 1 / 100, 0.7, float("nan"), float("inf")]
)
def test_known_bad_gpus(value):
    with pytest.raises(ProfileError, match=r"profile 'p': gpus .*got"):
        ResourceProfile(name="p", gpus=value)


@given(k=st.integers(min_value=2, max_value=MAX_SHARE))
def test_every_share_1_over_k_is_valid(k):
    prof = ResourceProfile(name="frac", gpus=1 / k)
    assert prof.gpus == 1 / k
    assert prof.share == Fraction(1, k)
    assert prof.devices_per_worker == 1
    assert prof.is_gpu and prof.uses_processes


def test_share_from_a_rounded_decimal_is_normalised():
    prof = ResourceProfile(name="third", gpus=0.333333333333)
    assert prof.share == Fraction(1, 3)
    assert prof.gpus == 1 / 3


@given(n=st.integers(min_value=1, max_value=512))
def test_whole_gpus_are_valid(n):
    prof = ResourceProfile(name="whole", gpus=n)
    assert prof.gpus == float(n)
    assert prof.share == 1
    assert prof.devices_per_worker == n


def test_zero_gpus_is_a_cpu_profile():
    prof = ResourceProfile(name="cpu")
    assert not prof.is_gpu
    assert prof.share == 0
    assert prof.devices_per_worker == 0
    assert prof.uses_processes is False
    assert ResourceProfile(name="cpu", processes=True).uses_processes is True


@pytest.mark.parametrize("field", ["gpus", "cpus", "max_workers", "idle_timeout", "priority"])
def test_booleans_are_not_numbers(field):
    # pydantic's lax mode would read `gpus = true` as one device
    with pytest.raises(ProfileError, match=rf"profile 'b': {field} must be a number, not true/false"):
        ResourceProfile(name="b", **{field: True})


# ------------------------------------------------------------------ cpus
@FAST
@given(
    value=st.one_of(
        st.floats(max_value=0.0),
        st.just(float("nan")),
        st.just(float("inf")),
        st.just(float("-inf")),
    )
)
def test_non_positive_or_non_finite_cpus_fail(value):
    with pytest.raises(ProfileError) as info:
        ResourceProfile(name="c", cpus=value)
    assert "profile 'c': cpus" in str(info.value)
    assert repr(value) in str(info.value)


@given(value=st.floats(min_value=1e-6, max_value=1024, allow_nan=False))
def test_positive_cpus_pass(value):
    assert ResourceProfile(name="c", cpus=value).cpus == value


# ---------------------------------------------------------------- memory
@FAST
@given(
    value=st.one_of(
        st.sampled_from(
            ["", "   ", "GiB", "lots", "16 foos", "1.2.3GB", "-5GiB", "0", "0.1", "1e400", "nan GB", "."]
        ),
        st.text(alphabet="abcxyz!@#", min_size=1, max_size=10),
        st.floats(allow_nan=True, allow_infinity=True).filter(lambda v: not (math.isfinite(v) and v >= 1)),
        st.integers(max_value=0),
        st.lists(st.integers(), max_size=2),
        st.booleans(),
    )
)
def test_bad_memory_fails_naming_memory(value):
    with pytest.raises(ProfileError) as info:
        ResourceProfile(name="m", memory=value)
    assert "profile 'm': memory" in str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("16GiB", 16 * 2**30), ("500 MB", 500 * 10**6), (1024, 1024), ("1kiB", 1024), (2.0**31, 2**31)],
)
def test_memory_sizes_parse(value, expected):
    assert ResourceProfile(name="m", memory=value).memory == expected
    assert ResourceProfile(name="g", gpus=1, gpu_memory_total=value).gpu_memory_total == expected
    assert ResourceProfile(name="g", gpus=1, gpu_memory_free=value).gpu_memory_free == expected


def test_bad_gpu_memory_and_rmm_pool_name_their_field():
    for field in ("gpu_memory_total", "gpu_memory_free"):
        with pytest.raises(ProfileError, match=rf"profile 'g': {field} must be a size"):
            ResourceProfile(name="g", gpus=1, **{field: "big"})
    with pytest.raises(ProfileError, match=r"profile 'g': cuda.rmm_pool_size must be a size"):
        ResourceProfile(name="g", gpus=1, cuda={"rmm_pool_size": "huge"})
    assert ResourceProfile(name="g", gpus=1, cuda={"rmm_pool_size": "2GiB"}).cuda.rmm_pool_size == 2 * 2**30


# --------------------------------------------------------- other fields
@FAST
@given(
    field=st.from_regex(r"\A[a-z][a-z_]{0,15}\Z").filter(
        lambda f: f not in ResourceProfile.model_fields and f != "gpu_memory"  # its old spelling
    )
)
def test_unknown_fields_fail_naming_the_field(field):
    with pytest.raises(ProfileError) as info:
        ResourceProfile(name="u", **{field: 1})
    msg = str(info.value)
    assert f"profile 'u': {field} is not a profile field" in msg
    assert "known fields:" in msg and "gpus" in msg


def test_unknown_cuda_option_lists_cuda_fields():
    with pytest.raises(
        ProfileError, match=r"cuda.pool is not a profile field \(known fields: enable_cudf_spill"
    ):
        ResourceProfile(name="u", gpus=1, cuda={"pool": 1})


@pytest.mark.parametrize(
    ("field", "value"), [("gpu_model", "H100"), ("gpu_memory_total", "40GiB"), ("gpu_memory_free", "40GiB")]
)
def test_gpu_only_fields_on_cpu_profile_fail(field, value):
    with pytest.raises(ProfileError, match=rf"profile 'cpu': {field} needs gpus > 0"):
        ResourceProfile(name="cpu", **{field: value})
    assert getattr(ResourceProfile(name="g", gpus=1, **{field: value}), field) is not None


def test_gang_rules():
    with pytest.raises(ProfileError, match=r"profile 'train': gang needs max_workers"):
        ResourceProfile(name="train", gpus=1, gang=True)
    with pytest.raises(ProfileError, match=r"gang needs gpus > 0"):
        ResourceProfile(name="train", gang=True, max_workers=2)
    assert ResourceProfile(name="train", gpus=1, gang=True, max_workers=2).gang


def test_processes_false_with_gpus_fails():
    with pytest.raises(ProfileError, match=r"profile 'g': processes=False is not possible with gpus > 0"):
        ResourceProfile(name="g", gpus=0.5, processes=False)
    assert ResourceProfile(name="c", processes=False).uses_processes is False


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"max_workers": 0}, "max_workers must be at least 1"),
        ({"idle_timeout": -1}, "idle_timeout must be a number of seconds >= 0"),
        ({"idle_timeout": float("nan")}, "idle_timeout must be a number of seconds >= 0"),
        ({"fallback": "gpu"}, "fallback"),
        ({"gpus": 1, "gpu_model": "   "}, "gpu_model must be a non-empty part"),
    ],
)
def test_other_bad_fields(fields, needle):
    with pytest.raises(ProfileError, match="profile 'x': " + needle):
        ResourceProfile(name="x", **fields)


def test_gpu_model_is_stripped():
    assert ResourceProfile(name="x", gpus=1, gpu_model=" H100 ").gpu_model == "H100"


def test_missing_name_and_several_errors_are_all_reported():
    with pytest.raises(ProfileError, match="name is required"):
        ResourceProfile(gpus=1)
    with pytest.raises(ProfileError) as info:
        ResourceProfile(name="x", cpus=-1, gpus=0.3)
    lines = str(info.value).splitlines()
    assert len(lines) == 2
    assert any("cpus" in line for line in lines) and any("gpus" in line for line in lines)


def test_profiles_are_frozen():
    prof = ResourceProfile(name="x")
    with pytest.raises(ValidationError):
        prof.gpus = 1  # type: ignore[misc]


# ------------------------------------------------------------------ tags
@given(name=NAMES)
def test_profile_tag_round_trip(name):
    tag = profile(name)
    assert tag == f"profile:{name}"
    assert ResourceProfile(name=name).tag == tag
    assert profile_from_tags(["etl", tag, "other"]) == name


def test_profile_tag_literal():
    assert profile("gpu") == "profile:gpu"


@pytest.mark.parametrize(
    "name",
    ["", " gpu", "gpu ", "has space", "-lead", "_lead", "a" * 64, "gpu\n", "profile:gpu", "gpü", 5, None],
)
def test_invalid_profile_names_are_rejected(name):
    with pytest.raises(ProfileError, match="profile name .* is not valid"):
        profile(name)  # type: ignore[arg-type]
    with pytest.raises(ProfileError):
        ResourceProfile(name=name)


def test_longest_name_is_accepted():
    assert profile("a" * 63) == "profile:" + "a" * 63
    with pytest.raises(ProfileError, match=r"\(at most 63 characters\)"):
        profile("a" * 64)


def test_profile_from_tags():
    from prefect import task

    assert profile_from_tags([]) is None
    assert profile_from_tags(["etl", "nightly"]) is None
    assert profile_from_tags(["profile:gpu", "profile:gpu"]) == "gpu"
    with pytest.raises(ProfileError, match=r"several profiles \(cpu, gpu\)"):
        profile_from_tags(["profile:gpu", "x", "profile:cpu"])
    train = task(name="train")(lambda: None)
    with pytest.raises(ProfileError, match=r"^task 'train' carries tags for several profiles \(cpu, gpu\)"):
        profile_from_tags(["profile:gpu", "profile:cpu"], train)


def test_a_profile_tag_prefix_in_another_case_is_read_not_ignored():
    """``Profile:GPU`` sends the task to profile ``GPU`` (the name keeps its case), never to the
    default; two names so written are two profiles."""
    from prefect import task

    assert profile_from_tags(["Profile:GPU"]) == "GPU"
    assert profile_from_tags(["PROFILE:gpu", "profile:gpu"]) == "gpu"
    with pytest.raises(ProfileError, match=r"^task 'train' carries tags for several profiles \(GPU, gpu\)"):
        profile_from_tags(["Profile:GPU", "profile:gpu"], task(name="train")(lambda: None))
    assert requested_profile(task(name="train", tags=["Profile:train"])(lambda: None)) == "train"


def test_an_unknown_profiles_fix_names_the_near_match_and_never_an_invalid_name():
    from gpu_tasks.profiles.tags import unknown_profile_fix

    for asked in ("gpu", " GPU", "GPU "):  # profile:gpu, profile: GPU
        assert unknown_profile_fix(asked, ["cpu", "GPU"]).startswith(
            "Did you mean 'GPU'? Tag the task profile:GPU"
        )
    bad = unknown_profile_fix(" tpu", ["cpu", "GPU"])
    assert "ResourceProfile(name=" not in bad and bad.startswith(
        "' tpu' is not a valid profile name: fix the tag"
    )
    assert "(at most 63 characters)" in bad
    assert unknown_profile_fix("tpu", ["cpu"]).startswith("Add a ResourceProfile(name='tpu', ...)")


@pytest.mark.parametrize("own", [["profile:"], ["profile:", "profile:gpu"], []])
def test_a_bare_profile_tag_is_an_unknown_profile_not_the_default(own):
    """``f"profile:{name}"`` with an empty name names no profile: an error, never the default."""
    from prefect import tags, task

    train = task(name="train", tags=own)(lambda: None)
    where = "task 'train'" if own else "a block around task 'train'"
    with tags(*([] if own else ["profile:"])):
        with pytest.raises(
            UnknownProfileError, match=rf"^{where} carries the tag 'profile:', which names no"
        ):
            requested_profile(train)


def test_use_profile_sets_prefect_tags():
    from prefect.context import TagsContext

    before = set(TagsContext.get().current_tags)
    assert "profile:gpu" not in before
    with use_profile("gpu"):
        assert "profile:gpu" in TagsContext.get().current_tags
    assert "profile:gpu" not in TagsContext.get().current_tags


def test_use_profile_rejects_bad_names_at_the_call():
    """As docs/profiles.md says: the call raises, not only entering its block."""
    with pytest.raises(ProfileError):
        use_profile("not valid")


def test_task_with_options_keeps_the_profile_tag():
    from prefect import task

    def f(x):
        return x

    t = task(tags=[profile("gpu")])(f)
    assert profile("gpu") in t.tags
    renamed = t.with_options(name="x")
    assert renamed.name == "x"
    assert profile("gpu") in renamed.tags
    assert profile_from_tags(renamed.tags) == "gpu"


# ------------------------------------------------------------------ TOML
GOOD_TOML = """
default = "light"

[profiles.light]
cpus = 0.5

[profiles.etl]
gpus = 0.25
memory = "8GiB"
gpu_model = "H100"

[profiles.train]
gpus = 2
gang = true
max_workers = 1
fallback = "cpu"
idle_timeout = 5
cuda = { rmm_pool_size = "24GiB", protocol = "ucx" }
"""


def test_load_good_file(tmp_path):
    path = tmp_path / "profiles.toml"
    path.write_text(GOOD_TOML)
    profiles, default = load_profiles_file(path)
    assert default == "light"
    assert list(profiles) == ["light", "etl", "train"]
    assert profiles["light"].cpus == 0.5 and not profiles["light"].is_gpu
    assert profiles["etl"].share == Fraction(1, 4)
    assert profiles["etl"].memory == 8 * 2**30
    assert profiles["train"].gang and profiles["train"].max_workers == 1
    assert profiles["train"].cuda.rmm_pool_size == 24 * 2**30
    assert profiles["train"].cuda.protocol == "ucx"
    assert all(name == p.name for name, p in profiles.items())
    # str paths work too
    assert load_profiles_file(str(path))[0] == profiles


def test_file_without_default(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("[profiles.gpu]\ngpus = 1\n")
    profiles, default = load_profiles_file(path)
    assert default is None
    assert profiles["gpu"].gpus == 1


def test_missing_file_names_path_and_where_it_was_named(tmp_path):
    """The message names the input the user gave: the variable when the path came from it, nothing
    they never set when it came from code."""
    path = tmp_path / "nope" / "profiles.toml"
    with pytest.raises(ProfileError) as info:
        load_profiles_file(path)
    assert str(info.value) == (
        f"profiles file {str(path)!r} cannot be read: No such file or directory; give the path of an "
        "existing TOML file"
    )
    with pytest.raises(ProfileError) as info:
        resolve_profiles(path=path, origin="GPU_TASKS_PROFILES_FILE")
    assert str(info.value).endswith(
        "(GPU_TASKS_PROFILES_FILE) cannot be read: No such file or directory; point "
        "GPU_TASKS_PROFILES_FILE at an existing TOML file"
    )


def test_an_undefined_default_says_how_to_fix_it(tmp_path):
    """default= naming no profile: define it or change default=; a file's default naming no profile
    fails even where default= replaces it (``gpu-tasks profiles --file`` rejects that file too)."""
    gpu = ResourceProfile(name="gpu", gpus=1)
    with pytest.raises(UnknownProfileError) as info:
        resolve_profiles([gpu], "fast")
    assert str(info.value) == (
        "default profile 'fast' is not defined; known profiles: gpu; define it "
        "(ResourceProfile(name='fast', ...) in profiles=[...]) or change default="
    )
    path = tmp_path / "p.toml"
    path.write_text('default = "nope"\n[profiles.gpu]\ngpus = 1\n')
    with pytest.raises(UnknownProfileError) as info:
        resolve_profiles([ResourceProfile(name="cpu")], "cpu", path)
    assert str(info.value) == (
        f"profiles file {str(path)!r}: default profile 'nope' is not defined; known profiles: cpu, gpu; "
        "add [profiles.nope] to the file or change its default"
    )


def test_invalid_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[profiles.gpu\ngpus = 1\n")
    with pytest.raises(ProfileError, match="is not valid TOML") as info:
        load_profiles_file(path)
    assert str(path) in str(info.value)


def test_non_utf8_file_is_a_profile_error(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"[profiles.caf\xe9]\ngpus = 1\n")
    with pytest.raises(ProfileError, match="is not valid TOML"):
        load_profiles_file(path)


def test_bad_field_names_file_profile_and_field(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("[profiles.ok]\ncpus = 1\n\n[profiles.etl]\ngpus = 0.3\n")
    with pytest.raises(ProfileError) as info:
        load_profiles_file(path)
    msg = str(info.value)
    assert str(path) in msg
    assert "profile 'etl'" in msg
    assert "gpus" in msg and "0.3" in msg


def test_unknown_field_in_file(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("[profiles.etl]\ngpu = 1\n")
    with pytest.raises(ProfileError, match=r"profile 'etl': gpu is not a profile field") as info:
        load_profiles_file(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('default = "x"\n', "expected \\[profiles.<name>\\] tables"),
        ("[profiles]\n", "expected \\[profiles.<name>\\] tables"),
        ("profiles = 3\n", "expected \\[profiles.<name>\\] tables"),
        ("default = 3\n[profiles.a]\ncpus = 1\n", "default must be a profile name string"),
        ("[profiles.a]\ncpus = 1\n[extra]\nx = 1\n", "unknown top-level keys \\['extra'\\]"),
        ("[profiles]\na = 1\n", "\\[profiles.a\\] must be a table of fields"),
        ('[profiles.a]\nname = "b"\n', "\\[profiles.a\\] sets name = 'b'"),
        ('[profiles."bad name"]\ncpus = 1\n', "profile 'bad name': name must start"),
    ],
)
def test_malformed_files(tmp_path, text, needle):
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=needle) as info:
        load_profiles_file(path)
    assert str(path) in str(info.value)


def test_profiles_from_mapping_names_its_source():
    out = profiles_from_mapping({"profiles": {"a": {"gpus": 1, "name": "a"}}})
    assert out["a"].gpus == 1
    with pytest.raises(ProfileError, match=r"^inline: profile 'b': cpus"):
        profiles_from_mapping({"profiles": {"b": {"cpus": 0}}}, source="inline")


# -------------------------------------------------------------- settings
def test_settings_read_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GPU_TASKS_PROFILES_FILE", str(tmp_path / "p.toml"))
    monkeypatch.setenv("GPU_TASKS_IDLE_TIMEOUT", "2.5")
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "H100:80GiB")
    monkeypatch.setenv("GPU_TASKS_DISCOVERY_COMMAND", "echo {}")
    monkeypatch.setenv("GPU_TASKS_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("GPU_TASKS_PROVISION_TIMEOUT", "7")
    monkeypatch.setenv("GPU_TASKS_DASHBOARD", "true")
    s = get_settings()
    assert s.profiles_file == tmp_path / "p.toml"
    assert s.idle_timeout == 2.5
    assert s.emulated_gpus == "H100:80GiB"
    assert s.discovery_command == "echo {}"
    assert (
        "data_dir" not in type(s).model_fields
    )  # GPU_TASKS_DATA_DIR is the pipeline's (gpu_tasks.pipeline.settings)
    assert s.provision_timeout == 7
    assert s.dashboard is True
    assert resolve(None, "idle_timeout", s) == 2.5
    assert resolve(9, "idle_timeout", s) == 9


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_profiles_file_setting_is_unset(monkeypatch, value):
    """GPU_TASKS_PROFILES_FILE="" is no file, as an unset variable: not Path("."), a directory."""
    monkeypatch.setenv("GPU_TASKS_PROFILES_FILE", value)
    assert get_settings().profiles_file is None


def test_settings_defaults(monkeypatch):
    for var in ("PROFILES_FILE", "IDLE_TIMEOUT", "EMULATED_GPUS", "DISCOVERY_COMMAND", "DASHBOARD"):
        monkeypatch.delenv(f"GPU_TASKS_{var}", raising=False)
    s = GpuTasksSettings()
    assert s.profiles_file is None and s.emulated_gpus is None and s.discovery_command is None
    assert s.idle_timeout == 60.0
    assert s.dashboard is False


@pytest.mark.parametrize("value", ["-1", "-0.5", "soon"])
def test_settings_reject_bad_idle_timeout(monkeypatch, value):
    monkeypatch.setenv("GPU_TASKS_IDLE_TIMEOUT", value)
    with pytest.raises(SettingsError, match="^invalid setting GPU_TASKS_IDLE_TIMEOUT="):
        get_settings()


def test_settings_reject_non_positive_provision_timeout(monkeypatch):
    monkeypatch.setenv("GPU_TASKS_PROVISION_TIMEOUT", "0")
    with pytest.raises(SettingsError, match="GPU_TASKS_PROVISION_TIMEOUT='0'"):
        get_settings()


# ------------------------------------------------ where a profile's values come from
def _sources(
    monkeypatch, env: dict[str, str], code, file_text: str | None = None, runner_idle=None, tmp_path=None
):
    from gpu_tasks.profiles import load_profiles_file, profile_sources, resolve_profiles

    for key in ("GPU_TASKS_IDLE_TIMEOUT", "GPU_TASKS_PRIORITY", "GPU_TASKS_PROFILES_FILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    path = None
    if file_text is not None:
        path = tmp_path / "profiles.toml"
        path.write_text(file_text)
    in_force, _ = resolve_profiles(code, "cpu", path)
    from_file = load_profiles_file(path)[0] if path else {}
    return profile_sources(code, in_force, path, from_file, runner_idle, GpuTasksSettings())


def test_a_deployments_idle_timeout_that_the_profiles_override_is_a_warning(monkeypatch):
    """The example's case: GPU profiles set idle_timeout=2 in code; GPU_TASKS_IDLE_TIMEOUT=30 from a
    deployment changes only the profile that leaves it unset, and says so; with every profile
    setting its own, it changes nothing and the warning says what to remove."""
    gpu = ResourceProfile(name="gpu-etl", gpus=1, idle_timeout=2)
    info, warnings = _sources(
        monkeypatch, {"GPU_TASKS_IDLE_TIMEOUT": "30"}, [ResourceProfile(name="cpu"), gpu]
    )
    assert info == ["GPU_TASKS_IDLE_TIMEOUT=30 sets idle_timeout of cpu (profiles that leave it unset)"]
    assert warnings == []
    cpu = ResourceProfile(name="cpu", idle_timeout=5)
    info, warnings = _sources(monkeypatch, {"GPU_TASKS_IDLE_TIMEOUT": "30"}, [cpu, gpu])
    assert info == []
    assert warnings == [
        "GPU_TASKS_IDLE_TIMEOUT=30 changes no profile: every profile sets its own idle_timeout (cpu=5s, "
        "gpu-etl=2s); remove the setting, or idle_timeout from the profiles (in code or in "
        "GPU_TASKS_PROFILES_FILE)"
    ]
    info, warnings = _sources(monkeypatch, {"GPU_TASKS_IDLE_TIMEOUT": "30"}, [gpu], runner_idle=10)
    assert info == [] and "ProfileTaskRunner(idle_timeout=10) is set in code and comes first" in warnings[0]
    # not given: nothing to say, whatever the profiles set
    assert _sources(monkeypatch, {}, [cpu, gpu]) == ([], [])


def test_the_profiles_file_and_the_priority_setting_are_named(monkeypatch, tmp_path):
    code = [ResourceProfile(name="cpu"), ResourceProfile(name="gpu-train", gpus=1)]
    text = "[profiles.gpu-train]\ngpus = 2\n\n[profiles.extra]\ncpus = 2\n"
    info, warnings = _sources(monkeypatch, {"GPU_TASKS_PRIORITY": "10"}, code, text, tmp_path=tmp_path)
    path = tmp_path / "profiles.toml"
    assert info == [
        f"profiles file {str(path)!r} (GPU_TASKS_PROFILES_FILE): extra, gpu-train; "
        "replacing the code's gpu-train",
        "GPU_TASKS_PRIORITY=10 replaces the priority of gpu-train",
    ]
    assert warnings == []
    info, warnings = _sources(monkeypatch, {"GPU_TASKS_PRIORITY": "10"}, [ResourceProfile(name="cpu")])
    assert info == [] and warnings == ["GPU_TASKS_PRIORITY=10 changes no profile: none asks for GPUs"]


def test_a_bad_field_in_a_profiles_file_is_named_with_its_line(tmp_path):
    """The file, the line and the field, in one line: the key's own line, a nested option's line in
    its sub-table, an inline table's line, the profile's header for a rule across fields."""
    cases = {
        "[profiles.cpu]\ncpus = 1\n\n[profiles.gpu]\ngpus = 1\nbogus = 3\n": (
            ", line 6: profile 'gpu': bogus is not a profile field"
        ),
        '[profiles.gpu]\ngpus = 1\n\n[profiles.gpu.cuda]\nrmm_pool_size = "lots"\n': (
            ", line 5: profile 'gpu': cuda.rmm_pool_size must be a size"
        ),
        "# ours\n[profiles]\ncpu = { cpus = 1 }\ngpu = { gpus = 0.3 }\n": (
            ", line 4: profile 'gpu': gpus must be a whole number"
        ),
        '[profiles."gpu"]\ngpus = 1\nname = "other"\n': ", line 3: [profiles.gpu] sets name = 'other'",
        "\n[profiles.gpu]\ngpus = 2\nprocesses = false\n": ", line 2: profile 'gpu': processes=False is not",
        # a rule across fields that starts with a field: that field's line
        '[profiles.gpu]\ngpus = 1\nquota = "team a"\n': ", line 3: profile 'gpu': quota must be a name",
        '[profiles.s]\ngpus = 1\ncluster_class = "a.B"\n': ", line 3: profile 's': cluster_class needs max_",
    }
    for i, (text, says) in enumerate(cases.items()):
        path = tmp_path / f"p{i}.toml"
        path.write_text(text)
        with pytest.raises(ProfileError) as info:
            load_profiles_file(path)
        assert str(info.value).startswith(f"profiles file {str(path)!r}{says}"), (text, str(info.value))


def test_a_deprecated_key_in_a_profiles_file_is_warned_at_its_line(tmp_path):
    """``gpu_memory``'s FutureWarning names the file and the key's line, not the code that read it."""
    path = tmp_path / "old.toml"
    path.write_text('[profiles.cpu]\ncpus = 1\n\n[profiles.train]\ngpus = 1\ngpu_memory = "40GiB"\n')
    with pytest.warns(FutureWarning, match="profile 'train': gpu_memory is deprecated") as caught:
        profiles, _ = load_profiles_file(path)
    assert [(w.filename, w.lineno) for w in caught] == [(str(path), 6)]
    assert profiles["train"].gpu_memory_total == 40 * 2**30
