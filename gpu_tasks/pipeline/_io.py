"""The pipeline's file I/O, one home each: atomic writes and Parquet reads whose errors name the file.

* :func:`atomic_directory` / :func:`move_into_place`: a directory (or file) built in a
  temporary sibling and renamed into place, so readers see the old version or the new
  one, never half of one;
* :func:`atomic_file`: a file written under a temporary name and ``os.replace``-d
  (:func:`write_json_atomic` for JSON);
* :func:`parquet_files` / :func:`parquet_row_count`: the part files of a dataset;
* :func:`parquet_errors`, :func:`read_schema_names`, :func:`read_parquet_frame`:
  Arrow and OS read errors turned into :class:`PipelineInputError` naming the path;
* :func:`remove_when_ended`: a run's intermediates removed once the tasks that read them ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from gpu_tasks.pipeline.errors import PipelineInputError

# --------------------------------------------------------------------------- atomic writes


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Build a directory in a temporary sibling and move it to ``final`` on success.

    Yields a fresh ``<final>.tmp-<uuid>`` directory. When the ``with`` block
    exits normally it replaces ``final`` (an older one is renamed aside, then
    removed); when the block raises, the temporary directory is deleted and
    ``final`` is left untouched.

    Args:
        final: The directory to create or replace.

    Yields:
        The temporary directory to write into.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex}")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    move_into_place(tmp, final)


def move_into_place(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``, replacing an existing ``final`` (file or directory).

    The old ``final`` is renamed aside first (directories cannot be replaced by one
    rename) and removed after the swap; if the swap fails it is put back.

    Args:
        tmp: The finished file or directory, on the same filesystem as ``final``.
        final: Its destination.
    """
    old: Path | None = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex}")
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if old is not None:  # put the previous complete version back
            os.rename(old, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


REMOVE_AFTER_S = 120.0  # a stage still running this long after its run stopped: its files go anyway


def remove_when_ended(path: Path, futures: list[Any]) -> None:
    """Remove ``path`` once every future in ``futures`` has ended: now if none runs, else from a thread.

    A flow stopped half-way (a Ctrl-C, a failed stage) must not delete the files a stage that is still
    running reads: that stage would fail with "does not exist" instead of ending as stopped. The task
    runner ends such stages when the flow run ends (its workers close), after the flow's own code; the
    thread is not a daemon, so the process removes the files before it exits.
    """
    running = [f for f in futures if not f.wrapped_future.done()]
    if not running:
        shutil.rmtree(path, ignore_errors=True)
        return

    def remove() -> None:
        for future in running:
            with contextlib.suppress(Exception):
                future.wrapped_future.exception(timeout=REMOVE_AFTER_S)
        shutil.rmtree(path, ignore_errors=True)

    threading.Thread(target=remove, name="gpu-tasks-pipeline-cleanup").start()


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; on success it is ``os.replace``-d onto ``path``.

    The temporary file is ``.<stem>.tmp-<uuid><suffix>`` (the suffix is kept for writers
    that pick the format from it) in ``path``'s directory, created if needed. When the
    block raises, it is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{uuid.uuid4().hex}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` as indented JSON to ``path`` atomically (:func:`atomic_file`).

    Args:
        path: Destination file; its parent directory is created if needed.
        payload: JSON-serialisable mapping.
    """
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")


# --------------------------------------------------------------------------- Parquet


def parquet_files(path: Path) -> list[Path]:
    """The Parquet files that make up a dataset: ``path`` itself or the files under it.

    Hidden files and files starting with ``_`` or ``.`` (metadata, markers) are skipped.

    Args:
        path: A ``.parquet`` file or a directory of part files.

    Returns:
        The files, sorted by path (empty when a directory holds none).
    """
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(
        p
        for p in path.rglob("*.parquet")
        if p.is_file() and not any(part.startswith(("_", ".")) for part in p.relative_to(path).parts)
    )


def parquet_row_count(path: Path) -> int:
    """Rows in a Parquet file or directory, read from the file footers only (cheap).

    Args:
        path: A ``.parquet`` file or a directory of part files.

    Returns:
        The total number of rows.
    """
    return sum(pq.ParquetFile(f).metadata.num_rows for f in parquet_files(path))


@contextlib.contextmanager
def parquet_errors(what: str) -> Iterator[None]:
    """Turn an OS or Arrow error in the block into :class:`PipelineInputError` ``"<what>: <error>"``."""
    try:
        yield
    except (OSError, pa.ArrowException) as exc:
        raise PipelineInputError(f"{what}: {exc}") from exc


def read_schema_names(file: Path, what: str | None = None) -> list[str]:
    """Column names of a Parquet file, from its footer.

    Raises:
        PipelineInputError: the file is unreadable (``what`` is added to the message).
    """
    with parquet_errors(f"cannot read Parquet file {file}" + (f" {what}" if what else "")):
        return list(pq.read_schema(file).names)


def read_parquet_frame(path: Path, columns: list[str]) -> Any:
    """``columns`` of a Parquet file or directory as one pandas frame.

    Raises:
        PipelineInputError: a file is unreadable.
    """
    import pandas as pd

    with parquet_errors(f"cannot read features in {path}"):
        return pd.read_parquet(path, columns=columns)
