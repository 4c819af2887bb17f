"""The file of begun hand-offs (gpu_tasks.worker.started): what a worker notes is what the flow process
reads, read in parts as it grows; a log it cannot read says "began", so a task is never run twice."""

from __future__ import annotations

import os

from gpu_tasks.worker.started import StartedLog, mark_started


def test_a_hand_off_noted_by_a_worker_is_read_as_begun_and_others_are_not():
    log = StartedLog()
    try:
        assert log.began("train-ab12-1")  # no file yet (no hand-off to a local worker): "began"
        path = log.path
        mark_started(path, "train step-ab12-1")  # a task name may have spaces and dashes
        assert log.began("train step-ab12-1") and not log.began("train step-ab12-2")
        mark_started(path, "other-cd34-1")  # added after the first read: read from where it stopped
        assert log.began("other-cd34-1") and not log.began("other-ef56-1")
    finally:
        log.close()
    assert not os.path.exists(path)
    assert log.began("never-0000-1")  # removed: unreadable, so reported as a crash, never run twice


def test_a_file_left_by_a_flow_process_that_is_gone_is_removed_by_the_next_runner(tmp_path, monkeypatch):
    import tempfile

    import psutil

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = 999_999_999  # above any pid_max: no such process
    assert not psutil.pid_exists(gone)
    left = tmp_path / f"gpu-tasks-started-{gone}-abc.log"  # killed with its workers, none removed it
    mine = tmp_path / f"gpu-tasks-started-{os.getpid()}-def.log"  # a live flow process's
    left.write_text("ab12-1\n")
    mine.write_text("")
    log = StartedLog()
    try:
        assert os.path.dirname(log.path) == str(tmp_path)
        assert not left.exists() and mine.exists()
    finally:
        log.close()


def test_a_noted_hand_off_tells_when_it_began_and_on_which_worker():
    """What the runner counts as busy for a task still running at its close (the ledger)."""
    import time

    log = StartedLog()
    try:
        assert log.since("train-ab12-1") is None  # no file yet
        path = log.path
        before = time.time()
        mark_started(path, "train step-ab12-1", "0,1")
        began = log.since("train step-ab12-1")
        assert began is not None and before - 0.001 <= began[0] <= time.time() + 0.001 and began[1] == "0,1"
        assert log.since("train step-ab12-2") is None
    finally:
        log.close()
    assert log.since("train step-ab12-1") is None  # removed: nothing to count
