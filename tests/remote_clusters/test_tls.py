"""tls:// address profiles, with certificates made in the test."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import cloudpickle
import pytest
from prefect import flow, task

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation
from gpu_tasks.errors import ClusterError
from gpu_tasks.profiles import TlsOptions
from remote_clusters.hosts import Hosts, make_tls_files

pytestmark = pytest.mark.slow
# the workers cannot import this test module: its flows and tasks travel by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _run(profile: ResourceProfile, n: int = 2) -> list:
    @task(tags=[f"profile:{profile.name}"])
    def where(i: int) -> tuple[str, ...]:
        return current_allocation().device_keys

    @flow(task_runner=ProfileTaskRunner(profiles=[profile]))
    def over_tls() -> list:
        futures = [where.submit(i) for i in range(n)]
        return [f.result(raise_on_failure=False) for f in futures]

    return over_tls()


def test_tls_address_with_the_profiles_certificates(tls_hosts: Hosts, tls_files: dict, prefect_server):
    assert tls_hosts.address.startswith("tls://")
    prof = ResourceProfile(name="secure", gpus=1, address=tls_hosts.address, security=TlsOptions(**tls_files))
    results = _run(prof)
    assert all(isinstance(r, tuple) and len(r) == 1 for r in results), results


def test_tls_certificates_from_settings(tls_hosts: Hosts, tls_files: dict, prefect_server, monkeypatch):
    monkeypatch.setenv("GPU_TASKS_TLS_CA_FILE", tls_files["ca_file"])
    monkeypatch.setenv("GPU_TASKS_TLS_CERT", tls_files["cert"])
    monkeypatch.setenv("GPU_TASKS_TLS_KEY", tls_files["key"])
    prof = ResourceProfile(name="secure-env", gpus=1, address=tls_hosts.address)
    assert all(isinstance(r, tuple) for r in _run(prof, 1))


def test_a_certificate_from_another_ca_is_a_clear_error_in_time(
    tls_hosts: Hosts, prefect_server, monkeypatch, tmp_path: Path
):
    monkeypatch.setenv("GPU_TASKS_PROVISION_TIMEOUT", "5")
    stranger = make_tls_files(tmp_path / "other-ca")
    prof = ResourceProfile(
        name="mismatch", gpus=1, address=tls_hosts.address, security=TlsOptions(**stranger)
    )
    started = time.monotonic()
    [error] = _run(prof, 1)
    assert time.monotonic() - started < 40
    assert isinstance(error, ClusterError), error
    assert "cannot connect to the Dask scheduler at tls://" in str(error)
    assert "certificates" in str(error) and "'mismatch'" in str(error)


def test_a_tls_scheduler_named_as_tcp_is_a_clear_error(tls_hosts: Hosts, prefect_server, monkeypatch):
    monkeypatch.setenv("GPU_TASKS_PROVISION_TIMEOUT", "5")
    prof = ResourceProfile(name="plain", gpus=1, address=tls_hosts.address.replace("tls://", "tcp://"))
    [error] = _run(prof, 1)
    assert isinstance(error, ClusterError), error
    assert "use a tls:// address with security" in str(error)


def test_an_unreadable_certificate_names_the_field(tls_hosts: Hosts, prefect_server, tmp_path: Path):
    missing = str(tmp_path / "nope.pem")
    prof = ResourceProfile(
        name="nofile", gpus=1, address=tls_hosts.address, security=TlsOptions(ca_file=missing)
    )
    [error] = _run(prof, 1)
    assert isinstance(error, ClusterError) and "security.ca_file" in str(error) and missing in str(error)
