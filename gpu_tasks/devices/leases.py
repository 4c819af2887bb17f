"""Per-host device leases (``flock`` on ``<lease_dir>/device-<address>.lock``) and the queue of waiters
for them (``<lease_dir>/queue/<unique>.json``). See docs/leases.md, "What a lease is"."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import socket
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from gpu_tasks.devices import fair_share, lease_files, presence
from gpu_tasks.devices.lease_files import PREFIX, QUEUE, SUFFIX, lock_path
from gpu_tasks.policy import waiter_rank
from gpu_tasks.reporting.events import RunRef
from gpu_tasks.settings import resolve


class Lease:
    """The open, locked files of some devices; :func:`release` closes them."""

    def __init__(self, lease_dir: Path, files: dict[str, int], info: dict[str, Any]):
        self.lease_dir = lease_dir
        self.files = files  # address -> open, locked file descriptor
        # address -> its other locked files (holder info, presence) and the path to delete on release
        self.held: dict[str, list[tuple[int, Path | None]]] = {}
        self.info = info

    def __repr__(self) -> str:
        return f"Lease({','.join(self.files) or '-'} in {self.lease_dir})"


class Waiter:
    """This process's place in the queue: its open, locked waiter file; :func:`dequeue` removes it."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self.files = {path.name: fd}  # closed in forked children, like a lease's
        self.held: dict[str, list[tuple[int, Path | None]]] = {}

    @property
    def name(self) -> str:
        """The waiter file's name: the last tie breaker of :func:`rank`."""
        return self.path.name

    def __repr__(self) -> str:
        return f"Waiter({self.path})"


_OPEN: weakref.WeakSet[Lease | Waiter] = weakref.WeakSet()


def _close_in_child() -> None:
    # closing a forked child's inherited copies keeps it from holding a device the parent released
    for lease in list(_OPEN):
        for fd in [*lease.files.values(), *(fd for held in lease.held.values() for fd, _ in held)]:
            with contextlib.suppress(OSError):
                os.close(fd)
        lease.files, lease.held = {}, {}


os.register_at_fork(after_in_child=_close_in_child)


def owner_info(profile: str | None = None, priority: int | None = None) -> dict[str, Any]:
    """Who is taking a lease now: this process, its flow run, ``profile`` and ``priority`` (when given)."""
    run = RunRef.current()
    info: dict[str, Any] = {
        "pid": os.getpid(),
        "uid": os.getuid(),
        "user": lease_files.user_name(os.getuid()),
        "hostname": socket.gethostname(),
        "flow_run_name": run.name,
        "flow_run_id": None if run.id is None else str(run.id),
        "profile": profile,
    }
    if priority is not None:
        info["priority"] = int(priority)
    return info


def take(addresses: Any, owner_info: dict[str, Any], lease_dir: Path | None = None) -> Lease | None:
    """Lease every device of ``addresses`` now, or none (``None``: one is held elsewhere); never waits.
    Raises ``OSError`` when the lease directory or a lock file cannot be opened."""
    lease_dir = Path(resolve(lease_dir, "lease_dir"))
    shared = lease_files.prepare(lease_dir)
    info = dict(owner_info, since=time.time())
    wanted = list(dict.fromkeys(addresses))
    if _held_elsewhere(lease_dir, wanted):  # a first look, so that a waiter does not lock in vain
        return None
    lease = Lease(lease_dir, {}, info)
    _OPEN.add(lease)
    try:
        for address in wanted:
            fd = lease.files[address] = lease_files.open_lock(lock_path(lease_dir, address), shared)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                release(lease)
                return None
            mine = dict(info, address=address)
            if shared:  # the lock file is not ours to write: the info goes in a file of our own
                lease.held[address] = [(lease_files.hold_info(lease_dir, address, mine), None)]
            else:
                lease_files.write_info(fd, mine)
        # mark first, look second: of two users' runs that try at once, at least one sees the other
        for address, (fd, path) in presence.mark(wanted, lease_dir, info).items():
            lease.held.setdefault(address, []).append((fd, path))
        taken = not _held_elsewhere(lease_dir, wanted)
    except BaseException:
        release(lease)
        raise
    if not taken:
        release(lease)
        return None
    return lease


def annotate(lease: Lease, addresses: Any, **fields: Any) -> None:
    """Add ``fields`` to the holder info of ``addresses`` of ``lease``."""
    lease.info.update(fields)
    for address in addresses:
        mine = dict(lease.info, address=address)
        held = lease.held.get(address) or []
        if held and held[0][1] is None:  # a shared directory: the info is in a file of our own
            lease_files.write_info(held[0][0], mine)
        elif address in lease.files:
            lease_files.write_info(lease.files[address], mine)


def _held_elsewhere(lease_dir: Path, addresses: list[str]) -> bool:
    """Whether another user's flow run holds any of ``addresses`` through another lease directory."""
    others = presence.elsewhere(lease_dir, addresses)
    for address, holder in others.items():
        presence.tell(address, holder)
    return bool(others)


def enqueue(
    addresses: Any,
    owner_info: dict[str, Any],
    priority: int = 0,
    arrived: float | None = None,
    lease_dir: Path | None = None,
    aging: float = 0.0,
) -> Waiter:
    """Register as a waiter for ``addresses`` until :func:`dequeue` (``aging``: seconds per +1 priority).
    Raises ``OSError`` when the queue directory cannot be written."""
    lease_dir = Path(resolve(lease_dir, "lease_dir"))
    queue = lease_files.prepare_queue(lease_dir, lease_files.prepare(lease_dir))
    info = dict(
        owner_info,
        priority=int(priority),
        arrived=time.time() if arrived is None else float(arrived),
        addresses=sorted(set(addresses)),
        aging=float(aging),
    )
    name = f"{uuid.uuid4().hex}.json"
    tmp = queue / f".{name}.tmp"
    # written and locked under a temporary name, then renamed: never seen unlocked or half written
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        os.fchmod(fd, 0o644)  # readable by every user of a shared directory, whatever the umask
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it open
        lease_files.write_info(fd, info)
        os.rename(tmp, queue / name)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    waiter = Waiter(queue / name, fd)
    _OPEN.add(waiter)
    return waiter


def dequeue(waiter: Waiter | None) -> None:
    """Leave the queue: delete the waiter file and its reason, then unlock it (by closing it)."""
    if waiter is None:
        return
    with contextlib.suppress(OSError):
        waiter.path.unlink()
    with contextlib.suppress(OSError):
        _why_path(waiter.path.parent, waiter.name).unlink()
    _close_all(waiter.files)


WHY = ".why"  # a waiter's reason: <lease_dir>/queue/<unique>.json.why


def _why_path(queue: Path, name: str) -> Path:
    return queue / f"{name}{WHY}"


def note_why(waiter: Waiter, why: dict[str, Any]) -> None:
    """Write why ``waiter`` waits next to its waiter file, for ``gpu-tasks waiters``; best effort."""
    path = _why_path(waiter.path.parent, waiter.name)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            os.fchmod(fd, 0o644)
            os.write(fd, json.dumps(why, default=str).encode())
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def read_why(lease_dir: Path | None, name: str) -> dict[str, Any] | None:
    """Why the waiter of file ``name`` waits (as :func:`note_why` wrote it), or ``None``."""
    path = _why_path(Path(resolve(lease_dir, "lease_dir")) / QUEUE, name)
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | lease_files.OPEN_FLAGS)
        try:
            return lease_files.read_info(fd) or None
        finally:
            os.close(fd)
    return None


def waiters(lease_dir: Path | None = None, usage: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """The live waiters in ``<lease_dir>/queue`` (each its file's JSON plus ``file``), first-ranked first.
    A file a non-blocking lock gets is a dead waiter's (even one SIGKILLed): left out and deleted."""
    lease_dir = Path(resolve(lease_dir, "lease_dir"))
    queue = lease_dir / QUEUE
    now = time.time()
    out = []
    for path in sorted(queue.glob("*.json")) if queue.is_dir() else []:
        try:
            fd = os.open(path, os.O_RDONLY | lease_files.OPEN_FLAGS)
        except OSError as exc:  # its waiter just left, not a waiter's file, or a link planted in the queue
            if isinstance(exc, (FileNotFoundError, PermissionError)) or exc.errno == errno.ELOOP:
                continue
            raise
        try:
            if lease_files.locked_elsewhere(fd):
                out.append(dict(lease_files.read_info(fd), file=path.name))
                continue
            # dead (names are never reused); another user's cannot be deleted in a sticky directory
            with contextlib.suppress(FileNotFoundError, PermissionError):
                path.unlink()
                _why_path(queue, path.name).unlink()
        finally:
            os.close(fd)
    if usage is None and out:
        usage = fair_share.read(lease_dir, now)
    return sorted(out, key=lambda w: rank(w, now, usage))


def effective_priority(info: dict[str, Any], now: float | None = None) -> int:
    """A waiter's ``priority`` plus one for every full ``aging`` seconds it has waited by ``now``."""
    return -rank(info, now)[0]


def rank(
    info: dict[str, Any], now: float | None = None, usage: Mapping[str, float] | None = None
) -> tuple[int, float, float, str]:
    """Sort key of a waiter at ``now`` (lower goes first: :func:`gpu_tasks.policy.waiter_rank`); compare
    only keys taken at one ``now``."""
    team = info.get("quota")
    return waiter_rank(
        int(info.get("priority") or 0),
        float(info.get("aging") or 0.0),
        float(info.get("arrived", math.inf)),
        time.time() if now is None else now,
        float((usage or {}).get(team, 0.0)) if team else 0.0,
        str(info.get("file") or "\uffff"),
    )


def ahead(
    me: dict[str, Any],
    others: Iterable[dict[str, Any]],
    addresses: Any,
    now: float | None = None,
    usage: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Those of ``others`` ranked before ``me`` at ``now`` that want any of ``addresses``, first first."""
    now = time.time() if now is None else now
    key, wanted = rank(me, now, usage), set(addresses)
    return sorted(
        (w for w in others if rank(w, now, usage) < key and wanted.intersection(w.get("addresses") or ())),
        key=lambda w: rank(w, now, usage),
    )


def release(lease: Lease | None, addresses: Any = None) -> None:
    """Give back ``addresses`` of ``lease`` (default: all of them)."""
    if lease is None:
        return
    for address in list(lease.files) if addresses is None else list(addresses):
        for side, path in lease.held.pop(address, []):  # presence and holder info first, then the lock
            presence.unmark(side, path)
        fd = lease.files.pop(address, None)
        if fd is not None:
            _close_all({address: fd})


def holders(lease_dir: Path | None = None, addresses: Any = None) -> dict[str, dict[str, Any] | None]:
    """Who holds each device now: its holder's info (``{}`` until written; ``elsewhere: true`` for another
    user's run in another lease directory), or ``None`` when free; default: every known device."""
    lease_dir = Path(resolve(lease_dir, "lease_dir"))
    if addresses is None:
        names = sorted(lease_dir.glob(f"{PREFIX}*{SUFFIX}")) if lease_dir.is_dir() else []
        found = [unquote(p.name[len(PREFIX) : -len(SUFFIX)]) for p in names]
        addresses = sorted(set(found) | set(presence.elsewhere(lease_dir)))
    return {address: holder(lease_dir, address) for address in addresses}


def holder(lease_dir: Path, address: str) -> dict[str, Any] | None:
    """Who holds device ``address`` now, or ``None`` when it is free (see :func:`holders`)."""
    lease_dir = Path(lease_dir)
    try:
        fd = os.open(lock_path(lease_dir, address), os.O_RDONLY | lease_files.OPEN_FLAGS)
    except FileNotFoundError:
        fd = -1
    if fd >= 0:
        try:
            if lease_files.locked_elsewhere(fd):
                if lease_files.is_shared(lease_dir):  # the holder's own info file names it
                    return lease_files.live_info(lease_dir, address) or {}
                return lease_files.read_info(fd)
        finally:
            os.close(fd)
    return presence.elsewhere(lease_dir, [address]).get(address)


def describe(
    info: dict[str, Any] | None, with_id: bool = True, priority: bool = True, hint: bool = True
) -> str:
    """``profile 'p' (priority 5, preemptible), flow run 'x' (id ...), pid 12`` (``None``: ``free``)."""
    if info is None:
        return "free"
    if not info:  # locked, yet no holder record: it read "pid ?" (a new-user pass)
        return (
            "a process that left no holder record (a program other than gpu-tasks holds the device's "
            "lock file, or a run is just taking it; fuser -v on the lock file names it)"
        )
    parts = []
    if info.get("profile"):
        notes = [f"priority {info['priority']}"] if priority and info.get("priority") is not None else []
        if info.get("preemptible"):
            notes.append("preemptible")
        if info.get("borrowed"):
            notes.append(f"borrowed beyond quota {info.get('quota')!r}")
        parts.append(f"profile {info['profile']!r}" + (f" ({', '.join(notes)})" if notes else ""))
    if info.get("flow_run_name") or info.get("flow_run_id"):
        run = f"flow run {info.get('flow_run_name')!r}"
        parts.append(f"{run} (id {info.get('flow_run_id') or '?'})" if with_id else run)
    elsewhere = bool(info.get("hostname")) and info["hostname"] != socket.gethostname()
    here = " (this process)" if info.get("pid") == os.getpid() and not elsewhere else ""
    parts.append(f"pid {info.get('pid', '?')}{here}")
    if elsewhere:
        parts.append(f"host {info['hostname']}")
    if info.get("user") and info.get("uid", os.getuid()) != os.getuid():
        parts.append(f"user {info['user']}")
    if info.get("elsewhere"):
        why = f" ({presence.HINT})" if hint else ""
        parts.append(f"in a lease directory this user does not share{why}")
    return ", ".join(parts)


def _close_all(files: dict[str, int]) -> None:
    for fd in files.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    files.clear()
