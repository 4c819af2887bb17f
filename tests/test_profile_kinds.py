"""The three kinds of profile (issue 48, item 1): each takes only its own fields, the kind follows
from the old spelling, ``gpu_memory`` became ``gpu_memory_total`` and ``gpu_memory_free``, and every
field says its unit (in its description and in docs/profiles.md's tables)."""

from __future__ import annotations

import re
import textwrap
import warnings
from pathlib import Path

import pytest

from gpu_tasks import CudaOptions, ResourceProfile, TlsOptions, profile, profile_tag
from gpu_tasks.devices.discovery import Inventory, parse_emulated
from gpu_tasks.errors import ProfileError
from gpu_tasks.policy import matching_devices, unsatisfiable_reason
from gpu_tasks.profiles import KIND_FIELDS, load_profiles_file

GiB = 2**30
DOCS = Path(__file__).resolve().parents[1] / "docs" / "profiles.md"
KINDS = ("local", "address", "cluster_class")
# each kind with what makes it one (kind given, so a foreign address/cluster_class meets the kind rule)
BASES = {
    "local": {"kind": "local"},
    "address": {"kind": "address", "address": "tcp://127.0.0.1:8786"},
    "cluster_class": {
        "kind": "cluster_class",
        "cluster_class": "dask_jobqueue.SLURMCluster",
        "max_workers": 2,
    },
}
# a value of each field that only some kinds take, with what it needs besides
SAMPLES = {
    "cpus": {"cpus": 2},
    "memory": {"memory": "2GiB"},
    "gpu_memory_free": {"gpus": 1, "gpu_memory_free": "8GiB"},
    "gpu_memory_per_task": {"gpu_memory_per_task": "8GiB"},
    "fallback": {"gpus": 1, "fallback": "cpu"},
    "processes": {"processes": True},
    "topology": {"gpus": 2, "topology": "nvlink"},
    "cpu_affinity": {"gpus": 1, "cpu_affinity": False},
    "cuda": {"gpus": 1, "cuda": {"rmm_pool_size": "1GiB"}},
    "gang": {"gpus": 1, "gang": True, "max_workers": 2},
    "max_workers": {"max_workers": 2},
    "preemptible": {"gpus": 1, "preemptible": True},
    "min_run_time": {"gpus": 1, "preemptible": True, "min_run_time": 60},
    "quota": {"gpus": 1, "quota": "team-a"},
    "address": {"address": "tcp://127.0.0.1:8786"},
    "security": {"security": {"ca_file": "ca.pem"}},
    "cluster_class": {"cluster_class": "dask_jobqueue.SLURMCluster"},
    "cluster_kwargs": {"cluster_kwargs": {"queue": "gpu"}},
}
EVERY_KIND = {"name", "kind", "gpus", "gpu_model", "gpu_memory_total", "idle_timeout", "priority", "on_oom"}


def _inventory(spec: str = "H100:80GiB,L4:24GiB") -> Inventory:
    return Inventory(devices=tuple(parse_emulated(spec)), source="emulated")


# ------------------------------------------------------------------ each kind, its own fields
def test_the_table_covers_every_field_and_the_samples_every_entry():
    assert set(KIND_FIELDS) | EVERY_KIND == set(ResourceProfile.model_fields)
    assert not set(KIND_FIELDS) & EVERY_KIND and set(SAMPLES) == set(KIND_FIELDS)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("field", sorted(KIND_FIELDS))
def test_a_kind_takes_its_own_fields_and_refuses_the_others_in_one_line(field, kind):
    kinds = KIND_FIELDS[field][0]
    fields = {**BASES[kind], **SAMPLES[field]}
    if kind in kinds:
        prof = ResourceProfile(name="p", **fields)
        assert prof.kind == kind and field in prof.model_fields_set
        return
    with pytest.raises(ProfileError) as info:
        ResourceProfile(name="p", **fields)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"profile 'p': {field} applies to "), msg
    assert f"not to this {kind} profile" in msg
    assert all(k in msg.split(", not to")[0] for k in kinds), "names the kinds that take it"
    assert re.search(r"; (remove|set|use) ", msg), "says what to do"


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_takes_the_common_fields(kind):
    prof = ResourceProfile(
        name="p",
        gpus=1,
        gpu_model="H100",
        gpu_memory_total="40GiB",
        idle_timeout=1.5,
        priority=3,
        on_oom="big",
        **BASES[kind],
    )
    assert (prof.kind, prof.gpu_memory_total, prof.priority) == (kind, 40 * GiB, 3)


def test_the_kind_follows_from_the_old_spelling():
    assert ResourceProfile(name="l", gpus=1).kind == "local"
    assert ResourceProfile(name="a", address="tcp://10.0.0.5:8786").kind == "address"
    assert ResourceProfile(name="c", cluster_class="a.B", max_workers=1).kind == "cluster_class"
    # said outright, it is the same profile
    assert ResourceProfile(name="a", kind="address", address="tcp://10.0.0.5:8786") == ResourceProfile(
        name="a", address="tcp://10.0.0.5:8786"
    )


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (
            {"kind": "address"},
            "kind='address' needs address: the scheduler's, e.g. 'tcp://gpu-scheduler:8786'",
        ),
        ({"kind": "cluster_class", "max_workers": 1}, "kind='cluster_class' needs cluster_class"),
        ({"kind": "remote"}, "kind Input should be 'local', 'address' or 'cluster_class'; got 'remote'"),
        ({"kind": "local", "address": "tcp://h:1"}, "address applies to address profiles, not to this local"),
        ({"address": "tcp://h:1", "cluster_class": "a.B"}, "address and cluster_class exclude each other"),
    ],
)
def test_a_kind_and_its_defining_field_must_agree(fields, says):
    with pytest.raises(ProfileError) as info:
        ResourceProfile(name="p", gpus=1, **fields)
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_a_dumped_profile_builds_again_without_warnings(kind):
    prof = ResourceProfile(name="p", gpus=1, gpu_model="H100", gpu_memory_total="40GiB", **BASES[kind])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ResourceProfile(**prof.model_dump()) == prof


# ------------------------------------------------------------------ old spellings
def test_old_gpu_memory_on_a_local_profile_means_total_and_free_and_warns_with_the_new_spelling():
    with pytest.warns(FutureWarning) as said:
        prof = ResourceProfile(name="train", gpus=2, gpu_memory="40GiB")
    assert (prof.gpu_memory_total, prof.gpu_memory_free) == (40 * GiB, 40 * GiB)
    [w] = said
    assert str(w.message) == (
        "profile 'train': gpu_memory is deprecated: write gpu_memory_total='40GiB' (devices with at least "
        "that much memory) and gpu_memory_free='40GiB' (that much free when a device is leased), which it "
        "stood for, or only the one you mean"
    )
    assert w.filename == __file__, "the warning points at the line that built the profile"
    with pytest.warns(FutureWarning, match="read gpu_memory_total"):
        assert prof.gpu_memory == 40 * GiB


def test_old_gpu_memory_on_an_address_profile_means_total_only():
    with pytest.warns(
        FutureWarning, match=r"write gpu_memory_total='40GiB' .*on this address profile"
    ) as said:
        prof = ResourceProfile(name="far", gpus=1, gpu_memory="40GiB", address="tcp://10.0.0.5:8786")
    assert "gpu_memory_free" not in str(said[0].message)
    assert (prof.gpu_memory_total, prof.gpu_memory_free) == (40 * GiB, None)


def test_old_and_new_gpu_memory_together_fail_naming_the_new_spelling():
    with pytest.raises(ProfileError, match=r"gpu_memory is the old spelling .* keep gpu_memory_total"):
        ResourceProfile(name="g", gpus=1, gpu_memory="40GiB", gpu_memory_total="40GiB")


def test_an_old_profiles_file_loads_as_before(tmp_path: Path):
    path = tmp_path / "profiles.toml"
    path.write_text(
        textwrap.dedent(
            """
            default = "cpu"
            [profiles.cpu]
            cpus = 1
            [profiles.train]
            gpus = 2
            gpu_model = "H100"
            gpu_memory = "40GiB"
            max_workers = 1
            [profiles.shared]
            gpus = 1
            address = "tls://gpu-scheduler:8786"
            [profiles.slurm]
            gpus = 1
            cluster_class = "dask_jobqueue.SLURMCluster"
            max_workers = 4
            """
        )
    )
    with pytest.warns(
        FutureWarning, match="profile 'train': gpu_memory is deprecated: write gpu_memory_total"
    ):
        profiles, default = load_profiles_file(path)
    assert default == "cpu"
    assert {n: p.kind for n, p in profiles.items()} == {
        "cpu": "local",
        "train": "local",
        "shared": "address",
        "slurm": "cluster_class",
    }
    assert profiles["train"].gpu_memory_total == profiles["train"].gpu_memory_free == 40 * GiB
    assert profile("train") == profile_tag("train") == "profile:train" == profiles["train"].tag


def test_a_profiles_file_says_the_kind_and_a_foreign_field_names_the_file(tmp_path: Path):
    path = tmp_path / "profiles.toml"
    path.write_text(
        '[profiles.shared]\nkind = "address"\naddress = "tcp://h:8786"\ngpus = 1\nmemory = "8GiB"\n'
    )
    with pytest.raises(ProfileError) as info:
        load_profiles_file(path)
    assert str(info.value).startswith(
        f"profiles file {str(path)!r}, line 5: profile 'shared': memory applies to local profiles, "
        "not to this address profile"
    )


# ------------------------------------------------------------------ total and free
def test_gpu_memory_total_picks_devices_by_their_size():
    inv = _inventory()
    big = ResourceProfile(name="big", gpus=1, gpu_memory_total="30GiB")
    assert [d.address for d in matching_devices(big, inv)] == ["0"]
    assert big.need_memory_free is None, "a device's size says nothing of what is free at the lease"
    huge = ResourceProfile(name="huge", gpus=1, gpu_memory_total="100GiB")
    reason = unsatisfiable_reason(huge, inv)
    assert reason is not None and "gpu_memory_total>=100.0GiB" in reason and "no device matches" in reason


def test_gpu_memory_free_is_needed_at_the_lease_and_rules_out_devices_too_small_to_ever_have_it():
    inv = _inventory()
    free = ResourceProfile(name="free", gpus=1, gpu_memory_free="30GiB")
    assert free.need_memory_free == 30 * GiB
    assert [d.address for d in matching_devices(free, inv)] == ["0"], "the 24 GiB L4 never has 30 GiB free"
    reason = unsatisfiable_reason(ResourceProfile(name="f", gpus=1, gpu_memory_free="90GiB"), inv)
    assert reason is not None and "gpu_memory_free>=90.0GiB" in reason
    # with memory as the request, the lease needs the larger of the two free
    both = ResourceProfile(name="m", gpu_memory_per_task="20GiB", gpu_memory_free="30GiB")
    assert both.need_memory_free == 30 * GiB
    assert ResourceProfile(name="m", gpu_memory_per_task="20GiB").need_memory_free == 20 * GiB


# ------------------------------------------------------------------ units, in the code and the docs
UNITS = {
    "cpus": "per task",
    "gpus": "per task",
    "memory": "per worker",
    "gpu_memory_total": "bytes",
    "gpu_memory_free": "bytes",
    "gpu_memory_per_task": "per task, bytes",
    "max_workers": "workers",
    "idle_timeout": "Seconds",
    "priority": "no unit",
    "min_run_time": "Seconds",
}


def test_every_field_has_a_description_and_the_numbers_their_unit():
    for model in (ResourceProfile, CudaOptions, TlsOptions):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
    for name, unit in UNITS.items():
        assert unit in (ResourceProfile.model_fields[name].description or ""), name
    assert "bytes" in (CudaOptions.model_fields["rmm_pool_size"].description or "")


def _doc_tables() -> dict[str, list[str]]:
    """docs/profiles.md, "Fields": the fields of each "### Kinds: ..." table."""
    text = DOCS.read_text()
    section = text[text.index("\n## Fields\n") :]
    section = section[: section.index("\n## ", 1)]
    tables: dict[str, list[str]] = {}
    heading = ""
    for line in section.splitlines():
        if line.startswith("### "):
            heading = line[4:].strip()
        elif (m := re.match(r"^\| `([a-z_]+)` \|", line)) and heading.startswith("Kinds:"):
            tables.setdefault(heading, []).append(m.group(1))
    return tables


def test_the_docs_list_every_field_once_under_the_kinds_that_take_it():
    tables = _doc_tables()
    documented = [f for fields in tables.values() for f in fields]
    assert sorted(documented) == sorted(ResourceProfile.model_fields), "each field in exactly one table"
    for heading, fields in tables.items():
        kinds = set(re.findall(r"`(local|address|cluster_class)`", heading)) or set(KINDS)
        for field in fields:
            assert set(KIND_FIELDS.get(field, (frozenset(KINDS),))[0]) == kinds, (heading, field)
