"""Which tests run where: the fast tier's modules and the parallel phase's heavy modules (read by
tests/conftest.py; a module of its own so that tests can import it by name)."""

# The fast tier (./scripts/test --fast): modules of pure logic and in-process checks. Their tests
# start no process: no Prefect server, no worker, no script (in that tier the `no_processes` guard
# of tests/conftest.py fails a test that does; a test of these modules that must start one is
# marked `processes` and left to the full suite). The tier runs in under 2 minutes; everything in
# it runs in the full suite too.
FAST_MODULES = (
    "tests/test_artifacts.py",
    "tests/test_devices.py",
    "tests/test_faults_report.py",
    "tests/test_layout.py",
    "tests/test_policy.py",
    "tests/test_profiles.py",
    "tests/test_profile_kinds.py",
    "tests/test_remote_profiles.py",
    "tests/pipeline/test_data.py",
    "tests/pipeline/test_etl.py",
    "tests/pipeline/test_settings.py",
    "tests/faults/test_worker_interrupts.py",
    "tests/test_cli.py",
    "tests/test_compat.py",
    "tests/test_measured.py",
    "tests/test_deployments.py",
    "tests/test_imports.py",
    "tests/test_topology.py",
    "tests/test_share_policy.py",
    "tests/test_borrowing_policy.py",
    "tests/test_wait_reasons.py",
    "tests/test_started_log.py",
)


# Seconds each module's tests took in the parallel phase (2026-11-27, /work/main, three processes;
# modules over 75 s): the order the processes start on, not a bound. Stale figures cost only balance.
HEAVY_MODULES = {
    "tests/remote_clusters/test_netns.py": 308,  # one host set of namespaces at a time: keep it whole
    "tests/test_preemption.py": 239,
    "tests/test_gpu_check.py": 169,
    "tests/remote_clusters/test_address.py": 118,
    "tests/test_conformance.py": 108,
    "tests/test_runner.py": 103,
    "tests/faults/test_api_busy.py": 101,
    "tests/faults/test_ctrl_c.py": 101,
    "tests/remote_clusters/test_shared_policies.py": 81,
    "tests/pipeline/test_main_job.py": 78,
}
