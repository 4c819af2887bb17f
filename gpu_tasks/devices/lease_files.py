"""The files of a lease directory, per-user or shared by several Unix users (then sticky); each opened
``O_NOFOLLOW`` and checked. See docs/shared-hosts.md, "What gpu-tasks does in a shared directory"."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import json
import os
import pwd
import shlex
import stat
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

PREFIX, SUFFIX = "device-", ".lock"
QUEUE = "queue"  # waiter files: <lease_dir>/queue/<unique>.json
HOLDER = "holder-"  # shared directories: holder-<quoted address>.<uid>.json, the live holder's info
SETUP_MODE = 0o3770  # setgid + sticky, group rwx, others nothing
OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_DOCS = "docs/shared-hosts.md, Several users on one host"
WRITABLE_FIX = "; set GPU_TASKS_LEASE_DIR to a directory this user can write"


class LeaseFileError(PermissionError):
    """A lease directory or file that gpu-tasks will not use as it is; the message names the fix."""


def lock_path(lease_dir: Path, address: str) -> Path:
    """The lock file of device ``address`` (addresses are quoted: MIG UUIDs may hold ``/``)."""
    return Path(lease_dir) / f"{PREFIX}{quote(address, safe='')}{SUFFIX}"


def user_name(uid: int) -> str:
    """The login name of ``uid``, or the number when it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _who(st: os.stat_result) -> str:
    mode = stat.S_IMODE(st.st_mode)
    return f"owner {user_name(st.st_uid)}, group {_group_name(st.st_gid)}, mode {mode:04o}"


def setup_command(lease_dir: Path, group: str) -> str:
    """The admin's command, with this environment's ``gpu-tasks`` by its full path where it is one:
    sudo's own PATH (secure_path) has no virtual environment in it."""
    here = Path(sys.executable).with_name("gpu-tasks")
    program = shlex.quote(str(here)) if here.is_file() else "gpu-tasks"
    return f"sudo {program} leases setup {str(lease_dir)!r} --group {group}"


def _setup_fix(lease_dir: Path, gid: int | None = None) -> str:
    return setup_command(lease_dir, _group_name(gid) if gid is not None else "GROUP")


def is_shared(lease_dir: Path) -> bool:
    """Whether ``lease_dir`` is shared by several users (group- or world-writable)."""
    try:
        st = os.stat(lease_dir)
    except FileNotFoundError:
        return False
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def prepare(lease_dir: Path) -> bool:
    """Make ``lease_dir`` (0700) when it is missing; whether it is shared (``LeaseFileError``: not sticky)."""
    lease_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(lease_dir)
    if not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return False
    if not st.st_mode & stat.S_ISVTX:
        raise LeaseFileError(
            f"lease directory {str(lease_dir)!r} ({_who(st)}) is writable by other users but not sticky: any "
            "of them could delete or replace another's lock file, and two flow runs could then use one "
            f"device. Fix: {_setup_fix(lease_dir, st.st_gid)} (or chmod +t {str(lease_dir)!r}); {_DOCS}"
        )
    return True


def problem(lease_dir: Path) -> str | None:
    """Why ``lease_dir`` cannot be used as it is (for ``gpu-tasks devices``), or ``None``."""
    path = Path(lease_dir)
    if not path.is_dir():  # made at the first lease, unless it or a parent is a file
        there = next((p for p in (path, *path.parents) if p.exists()), None)
        if there is None or there.is_dir():
            return None
        return f"lease directory {str(path)!r}: {str(there)!r} is a file, not a directory{WRITABLE_FIX}"
    try:
        prepare(Path(lease_dir))
    except LeaseFileError as exc:
        return str(exc)
    return join_group_fix(path)  # a user outside its group sees no holder and no waiter there


def prepare_queue(lease_dir: Path, shared: bool) -> Path:
    """The waiter queue of ``lease_dir``, made when missing: 0700, or in a shared one like its parent
    (``LeaseFileError`` if it is not shared)."""
    queue = Path(lease_dir) / QUEUE
    if not shared:
        queue.mkdir(mode=0o700, exist_ok=True)
        return queue
    parent = os.stat(lease_dir)
    with contextlib.suppress(FileExistsError):
        os.mkdir(queue, 0o700)
        if os.stat(queue).st_gid != parent.st_gid:  # a parent without setgid: take its group if we may
            with contextlib.suppress(OSError):
                os.chown(queue, -1, parent.st_gid)
        os.chmod(queue, stat.S_IMODE(parent.st_mode))  # setgid is dropped by the kernel for non-members
    st = os.lstat(queue)
    shared_too = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and st.st_mode & stat.S_ISVTX
    if not stat.S_ISDIR(st.st_mode) or not shared_too:
        raise LeaseFileError(
            f"queue directory {str(queue)!r} ({_who(st)}) of the shared lease directory is not shared "
            f"(group- or world-writable and sticky): other users could not wait for devices. Fix: "
            f"{_setup_fix(Path(lease_dir), parent.st_gid)}; {_DOCS}"
        )
    return queue


def open_lock(path: Path, shared: bool) -> int:
    """Open (making it when missing) the lock file ``path`` for ``flock``: read-only 0444 in a shared
    directory (the admin's are root-owned), 0644 in a per-user one; ``LeaseFileError`` names the fix."""
    flags = (os.O_RDONLY if shared else os.O_RDWR) | OPEN_FLAGS
    mode = 0o444 if shared else 0o644
    try:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
            os.fchmod(fd, mode)  # not the umask's
        except FileExistsError:
            fd = os.open(path, flags)
    except OSError as exc:
        raise _open_error(path, exc, shared) from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise LeaseFileError(f"{str(path)!r} is not a regular file ({_who(st)}): refused; {_DOCS}")
    return fd


def join_group_fix(lease_dir: Path) -> str | None:
    """For a user outside the group of a shared ``lease_dir``: that, and the fix; else ``None``."""
    try:
        where = os.stat(lease_dir)
    except OSError:
        return None
    member = where.st_gid == os.getgid() or where.st_gid in os.getgroups()
    if not where.st_mode & stat.S_IWGRP or member or os.getuid() in (0, where.st_uid):
        return None
    me, group = user_name(os.getuid()), _group_name(where.st_gid)
    if me in _group_members(where.st_gid):  # added since this session began: its processes lack it
        return (
            f"user {me} may not use lease directory {str(lease_dir)!r} ({_who(where)}): user {me} is in "
            f"group {group}, but this process is not (its session began before {me} joined it). Fix: log "
            f"in again, or run it under newgrp {group}; {_DOCS}"
        )
    return (
        f"user {me} may not use lease directory {str(lease_dir)!r} ({_who(where)}): not in its group. Fix: "
        f"add {me} to group {group} (sudo usermod -aG {group} {me}, then log in again); {_DOCS}"
    )


def _group_members(gid: int) -> list[str]:
    try:
        return list(grp.getgrgid(gid).gr_mem)
    except KeyError:
        return []


def _open_error(path: Path, exc: OSError, shared: bool) -> OSError:
    try:
        st = os.lstat(path)
    except PermissionError:  # the directory itself is closed to this user
        return LeaseFileError(join_group_fix(path.parent) or f"{exc}{WRITABLE_FIX}")
    except OSError:
        return exc
    if stat.S_ISLNK(st.st_mode):
        return LeaseFileError(
            f"lock file {str(path)!r} is a symbolic link (to {os.readlink(path)!r}, {_who(st)}): refused, a "
            "lock file must be a regular file. Someone put it there: its owner, the directory's owner "
            f"or root can remove it; {_DOCS}"
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        me = user_name(os.getuid())
        fix = (
            f"an admin makes every lock file root-owned and readable by all: {_setup_fix(path.parent)}"
            if shared
            else "use a lease directory of your own (unset GPU_TASKS_LEASE_DIR), or have this one set up as "
            f"a shared one: {_setup_fix(path.parent)}"
        )
        return LeaseFileError(
            f"cannot open lock file {str(path)!r} ({_who(st)}): user {me} may not "
            f"{'read' if shared else 'write'} it. Fix: {fix}; {_DOCS}"
        )
    return exc


def open_own(path: Path) -> int:
    """Open (making it when missing) a file of this user's own, 0644, in a directory others write too;
    ``LeaseFileError`` unless a regular file of this user with one link (no planted link)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | OPEN_FLAGS, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LeaseFileError(f"{str(path)!r} is a symbolic link: refused; {_DOCS}") from exc
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1:
        os.close(fd)
        raise LeaseFileError(
            f"{str(path)!r} ({_who(st)}, {st.st_nlink} link(s)) is not a file of this user's own: refused. "
            f"The directory's owner or root can remove it; {_DOCS}"
        )
    os.fchmod(fd, 0o644)
    return fd


def lock_own(fd: int) -> bool:
    """Lock this user's own file ``fd`` exclusively, retrying briefly past readers' instant shared locks."""
    for _ in range(50):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.002)
    return False


def hold_info(lease_dir: Path, address: str, info: dict[str, Any]) -> int:
    """Write the holder's ``info`` in its own file of a shared directory, locked until ``fd`` is closed."""
    fd = open_own(Path(lease_dir) / f"{HOLDER}{quote(address, safe='')}.{os.getuid()}.json")
    try:
        lock_own(fd)  # unlocked after all (a reader held it): its info reads as stale, the lease holds
        write_info(fd, info)
    except BaseException:
        os.close(fd)
        raise
    return fd


def live_info(lease_dir: Path, address: str) -> dict[str, Any] | None:
    """The live holder's info of ``address`` in a shared directory, or ``None``."""
    prefix = f"{HOLDER}{quote(address, safe='')}."
    for name in sorted(os.listdir(lease_dir)):
        uid = name[len(prefix) : -len(".json")]
        if not (name.startswith(prefix) and name.endswith(".json") and uid.isdigit()):
            continue
        info = read_locked(Path(lease_dir) / name, int(uid))
        if info is not None:
            return info
    return None


def read_locked(path: Path, uid: int) -> dict[str, Any] | None:
    """``path``'s JSON with its owner's ``user`` and ``uid`` when ``uid`` owns and locks it; else ``None``."""
    try:
        fd = os.open(path, os.O_RDONLY | OPEN_FLAGS)
    except OSError:  # gone, a link, not readable: not a live holder we can name
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return None
        return dict(read_info(fd), uid=uid, user=user_name(uid)) if locked_elsewhere(fd) else None
    finally:
        os.close(fd)


def locked_elsewhere(fd: int) -> bool:
    """Whether another open file holds a lock on ``fd``'s file: its holder or waiter is alive."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def write_info(fd: int, info: dict[str, Any]) -> None:
    """Replace the content of ``fd`` with ``info``'s JSON."""
    data = json.dumps(info, default=str).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def read_info(fd: int) -> dict[str, Any]:
    """The JSON object in ``fd`` (``{}`` when there is none)."""
    for _ in range(5):  # the holder truncates, then writes: retry a torn read briefly
        size = os.fstat(fd).st_size
        raw = os.pread(fd, max(size, 1), 0)
        try:
            info = json.loads(raw)
        except ValueError:
            time.sleep(0.01)
            continue
        return info if isinstance(info, dict) else {}
    return {}


def setup(lease_dir: Path, gid: int, addresses: list[str], mode: int = SETUP_MODE) -> list[str]:
    """Make ``lease_dir`` and its queue a shared lease directory ``root:<gid>`` (as root; idempotent) with
    root-owned 0444 lock files for ``addresses``: what was done, line by line."""
    if not mode & stat.S_ISVTX or mode & 0o070 != 0o070 or mode & stat.S_IWOTH:
        raise ValueError(f"mode {mode:04o}: must be sticky (1000), group rwx (070), not world-writable")
    held = [a for a in addresses if _held_users_lock(lock_path(lease_dir, a))]
    if held:  # replacing it would let a second run onto a device in use (a new-user pass: 1 of 1)
        raise LeaseFileError(
            f"the lock file of device(s) {', '.join(held)} in {str(lease_dir)!r} is a user's own and a "
            "flow run holds it now; replacing it would let another run use the device meanwhile. Run "
            "this again once no flow run holds it (gpu-tasks devices shows who holds what)"
        )
    done = []
    for path in (Path(lease_dir), Path(lease_dir) / QUEUE):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise LeaseFileError(f"{str(path)!r} is not a directory ({_who(st)}): remove it first")
        os.chown(path, 0, gid)
        os.chmod(path, mode)
        done.append(f"{path}: directory, owner root, group {_group_name(gid)}, mode {mode:04o}")
    for address in addresses:
        path = lock_path(lease_dir, address)
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:  # a link, or a user's own: replace it
                os.unlink(path)
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | OPEN_FLAGS, 0o444)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise LeaseFileError(f"{str(path)!r} is not a regular file: remove it first")
            os.fchown(fd, 0, 0)
            os.fchmod(fd, 0o444)
        finally:
            os.close(fd)
        done.append(f"{path}: lock file of device {address}, owner root, mode 0444")
    return done


def _held_users_lock(path: Path) -> bool:
    """Whether ``path`` is a lock file that setup would replace (not root's) and a run holds it now."""
    try:
        fd = os.open(path, os.O_RDONLY | OPEN_FLAGS)
    except OSError:  # none, or a link (replaced: it was never a lock)
        return False
    try:
        return os.fstat(fd).st_uid != 0 and locked_elsewhere(fd)
    finally:
        os.close(fd)
