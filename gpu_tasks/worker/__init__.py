"""Code that runs inside worker processes: Prefect's task engine on the worker's allocation
(``engine``), warm processes that hold no device until a lease binds one (``warm``), the guard
that takes a worker down with its flow process (``guard``), and what they share."""
