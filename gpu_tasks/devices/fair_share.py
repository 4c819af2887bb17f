"""Fair share over time: each team's decayed device use, kept in the lease directory
(``fair-share.<uid>.json``). See docs/leases.md, "Fair share"."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from gpu_tasks.devices import lease_files
from gpu_tasks.policy import decayed_usage
from gpu_tasks.settings import resolve

logger = logging.getLogger(__name__)

PREFIX = "fair-share."
ACCRUE_S = 30.0  # how often a runner adds the use of the devices it still holds


def _entry(entry: object, now: float, half_life: float) -> float:
    """A file's ``{"usage": ..., "at": ...}`` decayed to ``now`` (0 for anything else)."""
    if not isinstance(entry, dict):
        return 0.0
    return decayed_usage(float(entry.get("usage") or 0), float(entry.get("at") or now), now, half_life)


def read(lease_dir: Path, now: float | None = None, half_life: float | None = None) -> dict[str, float]:
    """Each team's usage (device-seconds) decayed to ``now``, every user's files added up."""
    half_life = float(resolve(half_life, "fair_share_half_life"))
    if half_life <= 0 or not Path(lease_dir).is_dir():
        return {}
    now = time.time() if now is None else now
    out: dict[str, float] = {}
    for file in sorted(Path(lease_dir).glob(f"{PREFIX}*.json")):
        try:
            fd = os.open(file, os.O_RDONLY | lease_files.OPEN_FLAGS)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            teams = lease_files.read_info(fd).get("teams") or {}
        except (OSError, ValueError):
            continue
        finally:
            os.close(fd)
        for team, entry in teams.items():
            out[team] = out.get(team, 0.0) + _entry(entry, now, half_life)
    return out


def add(
    lease_dir: Path, amounts: Mapping[str, float], now: float | None = None, half_life: float | None = None
) -> None:
    """Add ``amounts`` (device-seconds by team) to this user's usage file, decayed to ``now``."""
    half_life = float(resolve(half_life, "fair_share_half_life"))
    amounts = {t: a for t, a in amounts.items() if t and a > 0}
    if half_life <= 0 or not amounts:
        return
    now = time.time() if now is None else now
    lease_files.prepare(Path(lease_dir))
    fd = lease_files.open_own(Path(lease_dir) / f"{PREFIX}{os.getuid()}.json")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        teams = lease_files.read_info(fd).get("teams") or {}
        for team, amount in amounts.items():
            teams[team] = {"usage": _entry(teams.get(team), now, half_life) + amount, "at": now}
        lease_files.write_info(fd, {"teams": teams})
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def shares(usage: Mapping[str, float]) -> dict[str, float]:
    """Each team's part of all teams' decayed usage (0..1)."""
    total = sum(usage.values())
    return {t: (u / total if total > 0 else 0.0) for t, u in usage.items()}
