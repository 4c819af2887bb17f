"""Deployable entrypoint of the ETL -> train pipeline (``flows/etl_train.py:etl_train``)."""

from gpu_tasks.pipeline import etl_train

__all__ = ["etl_train"]

if __name__ == "__main__":
    print(etl_train())
