"""Code that runs inside worker processes: Prefect's task engine on the worker's allocation, warm
processes that hold no device until bound, the guard that takes a worker down with its flow."""
