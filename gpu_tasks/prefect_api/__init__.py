"""Prefect glue: which API a flow run reports to and the embedded server, the environment checked
before anything starts, tag slots and team quotas held as Prefect concurrency leases, and task-run
states for crashes and retries."""
