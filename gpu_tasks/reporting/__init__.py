"""What a flow run tells people: the resource ledger, Prefect events and artifacts, alerts, and
the runner's own log lines."""
