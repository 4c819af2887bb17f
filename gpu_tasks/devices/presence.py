"""Other users' flow runs on this host's devices, seen across lease directories: presence files
``device-<X>.<uid>.<key>.lock``, locked while a run holds X. See docs/shared-hosts.md."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from gpu_tasks.devices import lease_files

logger = logging.getLogger(__name__)

_warned: set[str] = set()
_told: set[tuple[str, int, Any]] = set()
HINT = (
    "to share this host's devices between users, point everyone's GPU_TASKS_LEASE_DIR at one shared "
    "directory (docs/shared-hosts.md, Several users on one host)"
)


def directory(path: Path | None = None) -> Path | None:
    """The presence directory, made 1777 when missing; ``None`` when it is not sticky and world-writable."""
    if path is None:
        from gpu_tasks.settings import default_presence_dir, get_settings

        try:
            path = get_settings().presence_dir
        except ValueError:  # a bad GPU_TASKS_* value: reported where settings are read for it
            path = default_presence_dir()
    path = Path(path)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
            os.chmod(path, 0o1777)
        st = os.lstat(path)
    except OSError as exc:
        _warn(path, f"cannot make it ({exc})")
        return None
    if not stat.S_ISDIR(st.st_mode) or (st.st_mode & 0o1007) != 0o1007:
        _warn(path, f"it is not a sticky directory everyone may write (mode {stat.S_IMODE(st.st_mode):04o})")
        return None
    return path


def _warn(path: Path, why: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        logger.warning(
            "presence directory %r is not used: %s. Other users' gpu-tasks flow runs on this host's devices "
            "are not seen, nor this one by them. Fix: sudo install -d -m 1777 -o root %r, or set "
            "GPU_TASKS_PRESENCE_DIR to such a directory; or %s",
            str(path),
            why,
            str(path),
            HINT,
        )


def key(lease_dir: Path) -> str:
    """Short name of a lease directory, the same for every user of it."""
    return hashlib.sha256(os.path.realpath(lease_dir).encode()).hexdigest()[:12]


def mark(addresses: Iterable[str], lease_dir: Path, info: dict[str, Any]) -> dict[str, tuple[int, Path]]:
    """Say that this flow run holds ``addresses``: each one's open, locked presence file (advisory)."""
    where = directory()
    if where is None:
        return {}
    shown = {k: v for k, v in info.items() if k != "preemptible"}  # other users cannot preempt it
    shown["lease_dir"] = str(lease_dir)
    out = {}
    for address in addresses:
        name = f"{quote(address, safe='')}.{os.getuid()}.{key(lease_dir)}"
        path = where / f"{lease_files.PREFIX}{name}{lease_files.SUFFIX}"
        try:
            fd = lease_files.open_own(path)
        except OSError as exc:
            _warn(where, f"{path.name}: {exc}")
            continue
        if not lease_files.lock_own(fd):
            os.close(fd)
            continue
        lease_files.write_info(fd, dict(shown, address=address))
        out[address] = (fd, path)
    return out


def unmark(fd: int, path: Path | None) -> None:
    """Delete this flow run's file ``path`` (if any), then unlock it (by closing it)."""
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.close(fd)


def elsewhere(lease_dir: Path, addresses: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
    """Holder info of ``addresses`` (default: any) that another user's run holds in another lease dir."""
    where = directory()
    if where is None:
        return {}
    wanted = None if addresses is None else set(addresses)
    me, mine = os.getuid(), key(lease_dir)
    out: dict[str, dict[str, Any]] = {}
    try:
        names = sorted(os.listdir(where))
    except OSError:
        return {}
    for name in names:
        if not (name.startswith(lease_files.PREFIX) and name.endswith(lease_files.SUFFIX)):
            continue
        parts = name[len(lease_files.PREFIX) : -len(lease_files.SUFFIX)].rsplit(".", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        address, uid, theirs = unquote(parts[0]), int(parts[1]), parts[2]
        if uid == me or theirs == mine or address in out or (wanted is not None and address not in wanted):
            continue
        info = lease_files.read_locked(where / name, uid)
        if info is not None:
            out[address] = dict(info, elsewhere=True)
    return out


def tell(address: str, info: dict[str, Any]) -> None:
    """Log, once per holder, that another user's flow run keeps this one off ``address``."""
    seen = (address, int(info.get("uid") or -1), info.get("pid"))
    if seen in _told:
        return
    _told.add(seen)
    logger.info(
        "device %s is leased by user %s's gpu-tasks flow run (pid %s, profile %r, flow run %r) in a lease "
        "directory this user does not share (%s): this flow run does not use it; %s",
        address,
        info.get("user"),
        info.get("pid", "?"),
        info.get("profile"),
        info.get("flow_run_name"),
        info.get("lease_dir") or "?",
        HINT,
    )
