"""Dask glue: the one place that builds workers and clusters (``backends``), a profile's cluster
on this host's leased devices (``local``), and clusters the runner does not start (``remote``:
``address=`` schedulers and ``cluster_class=`` managers), with the shared scheduler's board."""
