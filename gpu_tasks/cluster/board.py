"""Preemption on a shared Dask scheduler (``address`` profiles): a board of waiters in the scheduler's
metadata, for which preemptible holders of lower priority, or on borrowed quota, interrupt tasks."""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from gpu_tasks import borrowing
from gpu_tasks.borrowing import Ask, Claim
from gpu_tasks.preemption import may_preempt
from gpu_tasks.prefect_api.quotas import task_need

logger = logging.getLogger("gpu_tasks.runner")

BOARD = "gpu-tasks-waiters"  # the scheduler metadata key of the entries
STALE_S = 5.0  # an entry whose beat has not moved this long is a dead waiter's
AGAIN_S = 5.0  # a holder preempts for the same waiter at most this often
PRUNE_S = 60.0  # an entry whose beat has not moved this long is taken off the board


def effective_priority(entry: dict[str, Any]) -> int:
    """An entry's priority aged by its wait as of its last beat (:func:`gpu_tasks.policy.aged_priority`)."""
    from gpu_tasks.policy import aged_priority

    return aged_priority(
        int(entry.get("priority") or 0), float(entry.get("aging") or 0), float(entry.get("waited_s") or 0)
    )


def _dropper(token: str) -> Callable[..., None]:
    """For ``Client.run_on_scheduler``: remove ``token``'s entry (and cleared ones). A closure, so it
    travels by value: the scheduler needs no gpu-tasks."""

    board_key = BOARD  # a local: the closure carries the value

    def remove(dask_scheduler: Any = None) -> None:
        board = dask_scheduler.task_metadata.get(board_key)
        if isinstance(board, dict):
            board.pop(token, None)
            for key in [k for k, v in board.items() if v is None]:
                board.pop(key, None)

    return remove


def _mover(keys: list[str]) -> Callable[..., list[str]]:
    """For ``Client.run_on_scheduler``: move those of ``keys`` queued on an over-asked worker to one with
    room (Dask's own stealing leaves them). A closure, for the same reason as :func:`_dropper`."""
    wanted = list(keys)

    def move(dask_scheduler: Any = None) -> list[str]:
        stealing = dask_scheduler.extensions.get("stealing")
        moved: list[str] = []
        if stealing is None:
            return moved

        def used(ws: Any, r: str) -> float:
            return sum(float((t.resource_restrictions or {}).get(r, 0)) for t in ws.processing)

        def free(ws: Any, r: str) -> float:
            return float(ws.resources.get(r, 0)) - used(ws, r)

        # Dask's stealing moves a task without its resource count (its own stealing never moves one
        # with resources): each move left the old worker one GPU too many and the new one one too few
        # for good (a new-user pass: -3/+3 on an idle cluster, and a waiter that preempted twice).
        # Room is read from what each worker is given, and Dask's count is set to match it again.
        for ws in dask_scheduler.workers.values():
            for r in list(ws.used_resources):
                ws.used_resources[r] = used(ws, r)

        for key in wanted:
            ts = dask_scheduler.tasks.get(key)
            here = getattr(ts, "processing_on", None)
            if ts is None or ts.state != "processing" or here is None or not ts.resource_restrictions:
                continue
            if all(free(here, r) >= 0 for r in ts.resource_restrictions):
                continue  # its worker has room for all it was given: it starts there
            valid = dask_scheduler.valid_workers(ts)
            for ws in sorted(valid if valid is not None else dask_scheduler.running, key=lambda w: w.address):
                if ws is not here and all(free(ws, r) >= v for r, v in ts.resource_restrictions.items()):
                    stealing.move_task_request(ts, here, ws)
                    moved.append(key)
                    break
        return moved

    return move


def drop(client: Any, token: str) -> None:
    """Remove ``token``'s entry (Dask cannot delete metadata: the scheduler runs a function, else
    the entry is cleared to ``None``)."""
    try:
        client.run_on_scheduler(_dropper(token))
    except Exception:
        try:
            client.set_metadata([BOARD, token], None)
        except Exception:
            logger.debug("could not take waiter entry %s off the board", token, exc_info=True)


class SharedBoard:
    """One address profile's side of the board: its entry as a waiter, its preemptions as a holder."""

    def __init__(self, profile_name: str, need: float, preemptible: bool) -> None:
        self.token = uuid.uuid4().hex
        self.profile_name = profile_name
        self.need = float(need)  # GPU resource one task of the profile asks for
        self.preemptible = preemptible
        self.beat = 0
        self.posted: dict[str, Any] | None = None  # our entry while it is up
        self.seen: dict[str, tuple[int, float]] = {}  # token -> (beat, when it last moved)
        self.acted: dict[str, float] = {}  # token -> when we last preempted for it
        self.stale_s = STALE_S

    # ------------------------------------------------------------ waiter
    def wait_step(
        self,
        client: Any,
        me: dict[str, Any],
        pending: dict[str, float],
        grace: float,
        executing: Callable[[], set[str]],
        aging: float = 0.0,
        borrowed: Callable[[str], bool] = lambda key: False,
    ) -> dict[str, Any] | None:
        """Put up, renew or take down our entry; the entry when it has just passed ``grace`` (the
        ``preempting`` event). ``pending``: our keys not done, by hand-off time; ``executing()``: those
        started (a broadcast, asked only once one has waited); ``borrowed(key)``: on borrowed quota."""
        now = time.monotonic()
        after = min(grace, aging) if aging > 0 else grace
        old = {k: t for k, t in pending.items() if now - t >= after}
        queued = [k for k in old if k not in executing()] if old else []
        if not queued:
            self.take_down(client)
            return None
        waited = now - min(old[k] for k in queued)
        workers: list[str] = []
        with contextlib.suppress(Exception):  # where they are queued is a hint; without it any worker will do
            processing = client.processing()
            workers = sorted(str(w) for w, keys in processing.items() if set(map(str, keys)) & set(queued))
        self.beat += 1
        entry = {
            **me,
            "need": self.need,
            "workers": workers,
            "queued": len(queued),
            "waited_s": round(waited, 3),
            "preemption_grace": grace,
            "aging": aging,
            "beat": self.beat,
            "entitled": me.get("quota") is not None and any(not borrowed(k) for k in queued),
        }
        client.set_metadata([BOARD, self.token], entry)
        try:  # a worker freed for us (a preemption, a reclaim) may not be the one we are queued on
            client.run_on_scheduler(_mover(queued))
        except Exception:
            logger.debug(
                "could not move queued tasks of %s to free workers", self.profile_name, exc_info=True
            )
        first = waited >= grace and (self.posted is None or self.posted["waited_s"] < grace)
        self.posted = entry
        return entry if first else None

    def take_down(self, client: Any) -> None:
        """Take our entry down (we run, or the flow run ends)."""
        if self.posted is not None:
            self.posted = None
            drop(client, self.token)

    # ------------------------------------------------------------ holder
    def live_entries(self, client: Any) -> dict[str, dict[str, Any]]:
        """Other profiles' entries whose beat still moves, by token."""
        board = client.get_metadata([BOARD], default=None) or {}
        now = time.monotonic()
        out = {}
        for token, entry in board.items():
            if token == self.token or not isinstance(entry, dict):
                continue
            beat = int(entry.get("beat") or 0)
            last = self.seen.get(token)
            if last is None or last[0] != beat:
                self.seen[token] = (beat, now)
            elif now - last[1] > self.stale_s:
                if now - last[1] > PRUNE_S:
                    drop(client, token)  # its flow run died long ago: clear it off the board
                    self.seen.pop(token, None)
                continue  # its flow run stopped renewing it
            out[token] = entry
        return out

    def aged_ahead(self, client: Any, priority: int) -> list[dict[str, Any]]:
        """Waiters of lower priority whose aged priority now exceeds ``priority``: they go first."""
        out = []
        for entry in self.live_entries(client).values():
            effective = effective_priority(entry)
            if int(entry.get("priority") or 0) < priority < effective:
                out.append(dict(entry, effective_priority=effective))
        return out

    def owed(self, client: Any, workers: set[str]) -> list[Ask]:
        """The live entries owed devices within their quota, waiting on any of ``workers`` (or anywhere),
        as the policy's waiters: they keep borrowers off."""
        return [
            Ask(str(e["quota"]), task_need(float(e.get("need") or 1)), held=True)
            for e in self.live_entries(client).values()
            if e.get("entitled") and e.get("quota") and (not e.get("workers") or set(e["workers"]) & workers)
        ]

    def due_waiters(self, client: Any, priority: int, team: str | None = None) -> list[dict[str, Any]]:
        """Live entries that waited their grace and outrank us, highest first; with ``team`` (our
        borrowed quota's), first other teams' entitled entries, marked ``reclaimed_by``."""
        out = []
        now = time.monotonic()
        for token, entry in self.live_entries(client).items():
            if float(entry.get("waited_s") or 0) < float(entry.get("preemption_grace") or 0):
                continue  # up for aging, not yet for preemption
            if now - self.acted.get(token, -AGAIN_S) < AGAIN_S:
                continue
            owed = entry.get("quota")
            if self.preemptible and team is not None and entry.get("entitled") and owed not in (None, team):
                out.append(dict(entry, token=token, reclaimed_by=owed))
            elif may_preempt(entry, {"preemptible": self.preemptible, "priority": priority}):
                out.append(dict(entry, token=token))
        return sorted(
            out,
            key=lambda e: (
                not e.get("reclaimed_by"),
                -int(e.get("priority") or 0),
                -float(e.get("waited_s") or 0),
            ),
        )

    def victims(
        self,
        waiter: dict[str, Any],
        mine: dict[str, list[str]],
        per_task: float,
        claim: Callable[[str], Claim] | None = None,
    ) -> tuple[str, list[str]] | None:
        """``(worker, keys)``: our running tasks to interrupt for ``waiter``, on a worker it is queued on
        where we run the most; ``None``: none there. A reclaim takes only borrowed tasks
        (:func:`gpu_tasks.borrowing.reclaim_victims`), on any worker if need be (the task is moved)."""
        allowed = set(waiter.get("workers") or ())
        want = max(1, math.ceil(float(waiter.get("need") or 1) / max(per_task, 1e-9)))
        if waiter.get("reclaimed_by"):
            if claim is None:
                return None
            team, now = str(waiter["reclaimed_by"]), time.monotonic()
            ranked = sorted(
                mine.items(), key=lambda wk: (bool(allowed) and wk[0] not in allowed, -len(wk[1]))
            )
            for worker, keys in ranked:
                groups = [[(k, claim(k))] for k in keys]
                choice = borrowing.reclaim_victims(team, groups, min(want, len(keys)), now) if keys else None
                if choice is not None and choice.devices:
                    self.acted[str(waiter["token"])] = time.monotonic()
                    return worker, list(choice.devices)
            return None
        options = [(len(keys), w) for w, keys in mine.items() if keys and (not allowed or w in allowed)]
        if not options:
            return None
        _, worker = max(options)
        n = min(len(mine[worker]), want)
        self.acted[str(waiter["token"])] = time.monotonic()
        return worker, sorted(mine[worker])[:n]
