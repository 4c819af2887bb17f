"""DeviceBook: which profile's cluster holds each device within one runner, the queue for devices,
and the leases that extend it to every flow run on this host (:mod:`gpu_tasks.devices.leases`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from gpu_tasks import preemption
from gpu_tasks.devices import fair_share, leases, lending, programs, wait_reasons
from gpu_tasks.devices.discovery import Device
from gpu_tasks.devices.lease_files import WRITABLE_FIX, LeaseFileError, join_group_fix
from gpu_tasks.errors import ClusterError
from gpu_tasks.prefect_api import quotas
from gpu_tasks.reporting.events import RunRef
from gpu_tasks.settings import get_settings, resolve

logger = logging.getLogger(__name__)

# what a waiter file carries for gpu_tasks.preemption beyond leases.enqueue's own fields
_SHARED_WAITER_FIELDS = ("groups", "need", "preemptible", "preemption_grace", "quota")
# who runs a lease (leases.owner_info): left out of the holder info of this book's own
_RUN_FIELDS = frozenset(("pid", "uid", "user", "hostname", "flow_run_name", "flow_run_id"))
EXPLAIN_EVERY_S = 1.0  # how often a waiter works out why it waits
QUOTA_READ_EVERY_S = 5.0  # how often a waiter for a full quota reads its use from the API


class DeviceBook:
    """Device holders, leases and waiters of one entered runner (docs/leases.md, "Queueing and priority")."""

    def __init__(
        self,
        reclaim: Any = None,
        stop: threading.Event | None = None,
        log_every: float = 30.0,
        lease_dir: Path | None = None,
        lease_timeout: float | None = None,
        preemption_grace: float | None = None,
        on_preempting: Any = None,
        priority_aging: float | None = None,
        other_programs_memory: int | None = None,
        fair_share_half_life: float | None = None,
    ):
        self.holders: dict[str, str] = {}
        self.cond = threading.Condition()
        # reclaim(wanted_devices, by_profile, growing) -> None: idle holders close (a growing profile's:
        # those idle for a while)
        self.reclaim = reclaim
        self.stop = stop or threading.Event()
        self.log_every = log_every
        settings = get_settings()
        self.lease_dir = Path(resolve(lease_dir, "lease_dir", settings))
        self.lease_timeout = float(resolve(lease_timeout, "lease_timeout", settings))
        self.preemption_grace = float(resolve(preemption_grace, "preemption_grace", settings))
        self.on_preempting = on_preempting  # (owner, holders): a waiter past its grace asks them back
        self.priority_aging = float(resolve(priority_aging, "priority_aging", settings))
        # address -> this process's lease on it; its info is the holder's record
        self.leases: dict[str, leases.Lease] = {}
        self.quota_lease_seconds = float(settings.quota_lease_seconds)
        self.quotas: quotas.QuotaSlots | None = None
        self.quota_leases: dict[str, Any] = {}  # address -> the quota lease its group holds
        self.waiting: dict[int, dict[str, Any]] = {}  # this book's waiters (leases.rank fields), by id
        self.other_programs_memory = int(resolve(other_programs_memory, "other_programs_memory", settings))
        self.skipped: dict[str, list[str]] = {}  # profile -> why devices were skipped for it, for its ledger
        self.fair_share_half_life = float(resolve(fair_share_half_life, "fair_share_half_life", settings))
        # address (held in a quota) -> the time up to which its use is counted for its lease's team
        self.accounted: dict[str, float] = {}

    def acquire(
        self,
        owner: str,
        groups: list[tuple[Device, ...]],
        n: int,
        block: bool,
        priority: int = 0,
        at_least: int = 1,
        preemptible: bool = False,
        patient: bool = False,
        quota: str | None = None,
        need_memory: int | None = None,
        min_run_time: float = 0.0,
    ) -> list[int]:
        """Up to ``n`` indexes of ``groups`` whose devices are all free, now held by ``owner``; with
        ``block``, waits in the queue until ``at_least`` are (all or none); ``patient``: no lease timeout."""
        wanted = {d.address for g in groups for d in g}
        if quota is not None and groups and n > 0:
            self.quota_slots().check(owner, quota, len(groups[0]) * max(1, at_least))
        me: dict[str, Any] = {
            "profile": owner,
            "priority": int(priority),
            "arrived": time.time(),
            "addresses": sorted(wanted),
            "groups": [[d.address for d in g] for g in groups],
            "need": max(1, at_least),
            "preemptible": preemptible,
            "preemption_grace": self.preemption_grace,
            "aging": self.priority_aging,
            "quota": quota,
            "local": True,
            "need_memory": need_memory,
            "min_run_time": float(min_run_time or 0.0),
        }
        waiter: leases.Waiter | None = None
        waited_since = time.monotonic()
        foreign_since: float | None = None
        log = _WaitLog(self, owner, priority, sorted(wanted))
        try:
            while True:
                if self.stop.is_set() and n > 0:  # a grant now would start workers for a closing runner
                    if not block:
                        return []
                    raise ClusterError(f"profile {owner!r}: the runner stopped while waiting for devices")
                usage = self._usage()  # the teams' decayed usage, read outside the lock
                with self.cond:
                    free, foreign, first = self._take_free(owner, groups, n, me, usage)
                    if len(free) < at_least:  # all or none: give the part back, keep waiting
                        self._give_back(owner, [d.address for i in free for d in groups[i]])
                        free = []
                    if free or not block or n <= 0:
                        if free and time.monotonic() - waited_since > 0.5:
                            logger.info(
                                "profile %r: got devices after waiting %.1fs",
                                owner,
                                time.monotonic() - waited_since,
                            )
                        if free or n <= 0 or self.reclaim is None:
                            return free
                    else:
                        self.waiting[id(me)] = me
                if not block:  # a running profile that could use more: profiles idle a while give back
                    self.reclaim(wanted, owner, True)
                    return []
                with self.cond:
                    held_by = {self.holders[a] for a in wanted if self.holders.get(a) not in (None, owner)}
                if waiter is None:
                    waiter = self._enqueue(owner, me)
                now = time.monotonic()
                # the lease timeout runs while only other processes stand in the way
                if not foreign or held_by or any(w.get("local") for w in first):
                    foreign_since = None
                elif foreign_since is None:
                    foreign_since = now
                if not patient and foreign_since is not None and now - foreign_since >= self.lease_timeout:
                    raise ClusterError(
                        self._timeout_message(
                            owner,
                            sorted(wanted),
                            now - foreign_since,
                            first,
                            me.get("programs_seen", {}),
                            me.get("quota_full"),
                        )
                    )
                if self.reclaim is not None:
                    self.reclaim(wanted, owner, False)
                quota_full, others = me.pop("quota_full", None), me.pop("programs", None)
                log.waiting(now, held_by, foreign, first, quota_full, others)
                self._explain(me, wanted, waiter, log, quota_full, others, usage, foreign)
                if not log.asked and preemption.due(me, self.preemption_grace):
                    log.asked = self._ask_preemptible_holders(owner, me, log)
                with self.cond:
                    self.cond.wait(timeout=0.5)
        finally:
            if id(me) in self.waiting:
                with self.cond:
                    del self.waiting[id(me)]
                    self.cond.notify_all()  # waiters that let this one go first may go now
            leases.dequeue(waiter)

    def _explain(
        self,
        me: dict[str, Any],
        wanted: set[str],
        waiter: leases.Waiter | None,
        log: _WaitLog,
        quota_full: str | None,
        others: dict[str, str] | None,
        usage: dict[str, float],
        leased: set[str],
    ) -> None:
        """Work out why ``me`` waits (at most every ``EXPLAIN_EVERY_S``), note it beside its waiter file
        when it changed, and tell the caller's listener."""
        now = time.monotonic()
        if log.explained_at is not None and now - log.explained_at < EXPLAIN_EVERY_S:
            return
        log.explained_at = now
        owner, wall, team = me["profile"], time.time(), me.get("quota")
        try:  # saying why is a courtesy: the wait goes on without it
            with self.cond:
                infos = {
                    a: h for a, h in self._local_holders().items() if a in wanted and h["profile"] != owner
                }
                # only those leased elsewhere: reading a free device's holder locks it, failing others' take
                unheld = sorted(a for a in wanted & leased if self.holders.get(a) is None)
            for address, info in leases.holders(self.lease_dir, unheld).items():
                if info is not None:
                    infos[address] = dict(info, other_user=info.get("uid", os.getuid()) != os.getuid())
            ahead = tuple(
                wait_reasons.Ahead(
                    profile=w.get("profile"),
                    flow_run_name=w.get("flow_run_name"),
                    local=bool(w.get("local")),
                    priority=leases.effective_priority(w, wall),
                    team=w.get("quota"),
                    usage=float(usage.get(w["quota"], 0.0)) if w.get("quota") else 0.0,
                )
                for w in leases.ahead(me, self.rivals(usage, besides=owner), wanted, wall, usage)
            )
            if quota_full is not None and (
                log.quota_read_at is None or time.monotonic() - log.quota_read_at >= QUOTA_READ_EVERY_S
            ):
                log.quota_read_at = time.monotonic()
                try:
                    got = self.quota_slots().limit(quota_full)
                    log.quota_use = (int(got.active_slots), int(got.limit))
                except Exception:
                    log.quota_use = None
            used, limit = log.quota_use if quota_full is not None and log.quota_use else (None, None)
            view = wait_reasons.WaitView(
                profile=owner,
                priority=leases.effective_priority(me, wall),
                team=team,
                usage=float(usage.get(team, 0.0)) if team else 0.0,
                holders=tuple(wait_reasons.Holder.of(a, info) for a, info in sorted(infos.items())),
                quota_full=quota_full,
                quota_used=used,
                quota_limit=limit,
                ahead=ahead,
                programs=tuple(sorted((others or {}).items())),
                borrowing=lending.at_borrowing_limit(me) if quota_full is not None else None,
            )
            reason = wait_reasons.why_waiting(view, time.time())
        except Exception:
            logger.debug("profile %r: could not work out why it waits", owner, exc_info=True)
            return
        noted = reason.as_dict()
        if waiter is not None and noted != log.noted:
            log.noted = noted
            leases.note_why(waiter, noted)
        wait_reasons.tell(reason)

    def release(self, owner: str, devices: Any) -> None:
        """Give back ``devices`` held by ``owner`` and their leases; their use goes to its team."""
        now = time.time()
        with self.cond:
            used = self._give_back(owner, devices, now)
            self.cond.notify_all()
        self._count_use(used, now)

    def accrue(self) -> None:
        """Count the use of the devices still held so far, so a long hold weighs before it ends."""
        now, used = time.time(), dict[str, float]()
        with self.cond:
            for address, since in list(self.accounted.items()):
                team = self.leases[address].info["quota"]
                used[team] = used.get(team, 0.0) + max(0.0, now - since)
                self.accounted[address] = now
        self._count_use(used, now)

    def _count_use(self, used: dict[str, float], now: float) -> None:
        """Add ``used`` (device-seconds by team) to the lease directory's usage."""
        try:
            fair_share.add(self.lease_dir, used, now, self.fair_share_half_life)
        except OSError:
            logger.warning(
                "gpu-tasks: could not record the teams' device use in %s", self.lease_dir, exc_info=True
            )

    def _usage(self) -> dict[str, float]:
        """The teams' decayed usage now (``{}`` when fair share is off or it cannot be read)."""
        return fair_share.read(self.lease_dir, half_life=self.fair_share_half_life)

    def _take_free(
        self,
        owner: str,
        groups: list[tuple[Device, ...]],
        n: int,
        me: dict[str, Any],
        usage: dict[str, float] | None = None,
    ) -> tuple[list[int], set[str], list[dict[str, Any]]]:
        """Hold up to ``n`` free groups whose new devices lease now, leaving any a waiter ranked before ``me``
        wants (under ``cond``): their indexes, the devices others kept from us, the waiters let go first."""
        free: list[int] = []
        foreign: set[str] = set()
        first: dict[int, dict[str, Any]] = {}
        rivals: list[dict[str, Any]] | None = None
        now = time.time()  # one instant for every effective priority compared in this round
        try:
            for i, g in enumerate(groups):
                if len(free) >= n:
                    break
                held = [self.holders.get(d.address) for d in g]
                if any(h not in (None, owner) for h in held) or all(h == owner for h in held):
                    continue
                if rivals is None:
                    rivals = self.rivals(usage or {}, besides=owner)
                before = leases.ahead(me, rivals, [d.address for d in g], now, usage)
                if before and me["quota"] is not None:  # a waiter beyond its quota yields to one owed it
                    before = lending.still_ahead(me, before)
                if before:
                    first.update((id(w), w) for w in before)
                    foreign.update(d.address for d in g if any(not w.get("local") for w in before))
                    continue
                new = [d.address for d in g if d.address not in self.holders]  # not empty: see above
                info = dict(
                    leases.owner_info(owner, me["priority"]), preemptible=me["preemptible"], quota=me["quota"]
                )
                if me["min_run_time"] > 0:
                    info["min_run_time"] = me["min_run_time"]
                lease = leases.take(new, info, self.lease_dir)
                if (
                    lease is None
                    or self._kept_by_programs(me, [d for d in g if d.address in new], lease)
                    or (me["quota"] is not None and not self._take_quota(me, new, lease))
                ):
                    foreign.update(new)
                    continue
                for address in new:
                    self.leases[address] = lease
                    if me["quota"] is not None:
                        self.accounted[address] = float(lease.info["since"])
                for d in g:
                    self.holders[d.address] = owner
                free.append(i)
        except BaseException as exc:  # a quota the API could not answer for, an interrupt: nothing kept
            self._give_back(owner, [d.address for i in free for d in groups[i]])
            if isinstance(exc, OSError):
                raise self._lease_error(owner, exc) from exc
            raise
        return free, foreign, sorted(first.values(), key=lambda w: leases.rank(w, now, usage))

    def _give_back(self, owner: str, addresses: Any, now: float | None = None) -> dict[str, float]:
        """Stop ``owner`` holding ``addresses``; with ``now`` (a release), their uncounted use by team."""
        used: dict[str, float] = {}
        for address in addresses:
            if self.holders.get(address) == owner:
                del self.holders[address]
                lease = self.leases.pop(address)
                if (counted := self.accounted.pop(address, None)) is not None and now is not None:
                    team = lease.info["quota"]
                    used[team] = used.get(team, 0.0) + max(0.0, now - counted)
                leases.release(lease, [address])
                self._release_quota(address)
        return used

    def _kept_by_programs(self, me: dict[str, Any], devices: list[Device], lease: leases.Lease) -> bool:
        """Whether programs outside gpu-tasks keep ``me`` off ``devices`` just leased (then the lease is
        given back; why is kept in ``me`` for the wait log and in :attr:`skipped` for the ledger)."""
        uses = programs.sample(devices, self.lease_dir)
        why = {
            d.address: reason
            for d in devices
            if (reason := programs.blocked(uses[d.address], self.other_programs_memory, me["need_memory"]))
        }
        if not why:
            return False
        leases.release(lease, [d.address for d in devices])
        me.setdefault("programs", {}).update(why)
        me["programs_seen"] = dict(me.get("programs_seen", {}), **why)
        seen = self.skipped.setdefault(me["profile"], [])
        for address, reason in why.items():
            text = f"device {address}: {reason}"
            if text not in seen and len(seen) < 5:
                seen.append(text)
        return True

    def skips(self, owner: str) -> list[str]:
        """Why devices were skipped for ``owner`` since the last call (programs outside gpu-tasks)."""
        with self.cond:
            return self.skipped.pop(owner, [])

    def rivals(self, usage: dict[str, float], besides: str | None = None) -> list[dict[str, Any]]:
        """Copies of this book's waiters (but ``besides``'s) and other processes' live waiters."""
        with self.cond:
            local = [dict(w) for w in self.waiting.values() if besides is None or w["profile"] != besides]
            mine = {w.get("file") for w in self.waiting.values()}
        return local + [w for w in leases.waiters(self.lease_dir, usage) if w["file"] not in mine]

    def _enqueue(self, owner: str, me: dict[str, Any]) -> leases.Waiter:
        """Register ``me`` as a waiter file, so other processes let it go first when it ranks first."""
        try:
            info = dict(leases.owner_info(owner), **{k: me[k] for k in _SHARED_WAITER_FIELDS})
            waiter = leases.enqueue(
                me["addresses"], info, me["priority"], me["arrived"], self.lease_dir, aging=me["aging"]
            )
        except OSError as exc:
            raise self._lease_error(owner, exc) from exc
        with self.cond:
            me["file"] = waiter.name
        return waiter

    def quota_slots(self) -> quotas.QuotaSlots:
        """This book's quota leases (made on first use, in the flow run's context)."""
        if self.quotas is None:
            self.quotas = quotas.QuotaSlots(self.quota_lease_seconds, RunRef.current().id)
        return self.quotas

    def _take_quota(self, me: dict[str, Any], new: list[str], lease: leases.Lease) -> bool:
        """Room in ``me``'s quota for the devices ``new`` just leased (else the lease is given back)."""
        try:
            lease_id = self.quota_slots().take(me["quota"], len(new))
            if lease_id is None and me["preemptible"]:  # beyond its quota: borrow, if allowed
                lease_id = lending.borrow(self, me, new, lease)
        except Exception as exc:
            leases.release(lease, new)
            raise ClusterError(
                f"profile {me['profile']!r}: could not take room in quota {me['quota']!r} "
                f"({quotas.limit_name(me['quota'])}) from the Prefect API: {type(exc).__name__}: {exc}"
            ) from exc
        if lease_id is None:
            leases.release(lease, new)
            me["quota_full"] = me["quota"]
            return False
        for address in new:
            self.quota_leases[address] = lease_id
        return True

    def _release_quota(self, address: str) -> None:
        """Give back the quota slots of ``address``'s group once none of its devices is held."""
        lease_id = self.quota_leases.pop(address, None)
        if lease_id is not None and lease_id not in self.quota_leases.values():
            self.quota_slots().release(lease_id)

    def close(self) -> None:
        """Give back what outlives the holders' releases (quota leases, their renewal)."""
        if self.quotas is not None:
            self.quotas.close()

    def _local_holders(self) -> dict[str, dict[str, Any]]:
        """The holder info of each device this book holds, ``local`` and without its run (under ``cond``)."""
        return {
            a: {k: v for k, v in self.leases[a].info.items() if k not in _RUN_FIELDS} | {"local": True}
            for a in self.holders
        }

    def _holder_of(self) -> preemption.HolderOf:
        """Who holds a device now: a profile of this book, another process's lease, or ``None``."""
        with self.cond:
            mine = self._local_holders()
        cache: dict[str, dict[str, Any] | None] = {}

        def holder_of(address: str) -> dict[str, Any] | None:
            if address in mine:
                return mine[address]
            if address not in cache:
                cache[address] = leases.holders(self.lease_dir, [address]).get(address)
            return cache[address]

        return holder_of

    def _ask_preemptible_holders(self, owner: str, me: dict[str, Any], log: _WaitLog) -> bool:
        """Past its grace: say which preemptible holders give devices back, or until when protected."""
        holder_of = self._holder_of()
        now = time.time()
        choice = preemption.choose(me, holder_of, now)
        if not choice.devices:
            if choice.protected_until is not None:
                log.protected(now, choice.protected_until, self.holders_text(list(choice.protected)))
            return False
        holders = [{"address": a, **(holder_of(a) or {})} for a in choice.devices]
        text = "; ".join(f"device {h['address']}: {_describe(h, local_priority=True)}" for h in holders)
        logger.info(
            "profile %r (priority %d) waited %.1fs (GPU_TASKS_TUNE_PREEMPTION_GRACE %gs): preemptible work "
            "gives its devices back: %s",
            owner,
            me["priority"],
            time.time() - me["arrived"],
            me["preemption_grace"],
            text,
        )
        if self.on_preempting is not None:
            self.on_preempting(owner, holders)
        return True

    def preemption_due(self, preemptible: set[str]) -> tuple[dict[str, Any], list[str]] | None:
        """The first-ranked waiter past its grace owed devices of ``preemptible`` profiles, and those."""
        with self.cond:
            if not any(o in preemptible for o in self.holders.values()):
                return None
        usage = self._usage()
        rivals = self.rivals(usage)
        now = time.time()
        holder_of: preemption.HolderOf | None = None
        for waiter in sorted(rivals, key=lambda w: leases.rank(w, now, usage)):
            if not preemption.due(waiter, self.preemption_grace, now):
                continue
            holder_of = holder_of or self._holder_of()
            ours = [a for a in preemption.plan(waiter, holder_of) if self.holders.get(a) in preemptible]
            if ours:
                return waiter, ours
        return None

    def _lease_error(self, owner: str, exc: OSError) -> ClusterError:
        own = isinstance(exc, LeaseFileError)  # it names its fix
        join = not own and isinstance(exc, PermissionError) and join_group_fix(self.lease_dir)
        fix = f". {join}" if join else "" if own else WRITABLE_FIX
        return ClusterError(f"profile {owner!r}: cannot lease devices in {str(self.lease_dir)!r}: {exc}{fix}")

    @staticmethod
    def waiters_text(waiters: list[dict[str, Any]]) -> str:
        """``profile 'x' of this flow run (priority 0, aged to 2, waiting 3.0s for devices 0,1); ...``."""
        now = time.time()
        parts = []
        for w in waiters:
            who = _describe(w, priority=False)
            waited = max(0.0, now - float(w.get("arrived", now)))
            base, effective = int(w.get("priority") or 0), leases.effective_priority(w, now)
            aged = f", aged to {effective}" if effective != base else ""
            parts.append(
                f"{who} (priority {base}{aged}, waiting {waited:.1f}s for devices "
                f"{','.join(w.get('addresses') or ())})"
            )
        return "; ".join(parts)

    def quota_text(self, quota: str) -> str:
        """``2 of 2 devices in use; on this host: device 0: profile 'a' ..., pid 12`` for ``quota``."""
        try:
            limit = self.quota_slots().limit(quota)
            use = f"{limit.active_slots} of {limit.limit} device(s) in use"
        except Exception:
            use = "use unknown"
        with self.cond:
            mine = [dict(h, address=a) for a, h in self._local_holders().items() if a in self.quota_leases]
        here = [
            f"device {h['address']}: {_describe(h, with_id=False)}"
            for h in quotas.holders_here(quota, leases.holders(self.lease_dir)) + mine
        ]
        if here:
            return use + "; held on this host by " + "; ".join(here)
        lease = get_settings().quota_lease_seconds
        return (
            f"{use}; none held by a running flow run on this host (a killed flow run's slots free when "
            f"their lease ends: GPU_TASKS_TUNE_QUOTA_LEASE_SECONDS, {lease:g}s, and the Prefect server's "
            "next sweep of expired leases, about 15 s more)"
        )

    def holders_text(self, addresses: list[str], held_only: bool = False) -> str:
        """``device 0: flow run 'x' (id ...), pid 12`` for each of ``addresses`` (``held_only``: but
        those that are free by now)."""
        holder_of = self._holder_of()
        held = [(a, holder_of(a)) for a in addresses]
        return "; ".join(f"device {a}: {_describe(h)}" for a, h in held if h is not None or not held_only)

    def _timeout_message(
        self,
        owner: str,
        wanted: list[str],
        waited: float,
        first: list[dict[str, Any]],
        others: dict[str, str],
        quota: str | None = None,
    ) -> str:
        if quota is not None:  # its team's quota is full: that is what it waited for, not the devices
            return (
                f"profile {owner!r}: waited {waited:.1f}s for room in quota {quota!r} "
                f"({self.quota_text(quota)}; devices: {self.holders_text(wanted)}). Wait for that team's "
                f"flow runs to end, raise the quota (gpu-tasks quotas set {quota} N), or wait longer: raise "
                f"GPU_TASKS_LEASE_TIMEOUT (now {self.lease_timeout:g}s)"
            )
        queued = f"; waiters that rank before it: {self.waiters_text(first)}" if first else ""
        used = f"; programs outside gpu-tasks: {_programs_text(others)}" if others else ""
        beside = programs.limit_fix(others.values(), self.other_programs_memory)
        return (
            f"profile {owner!r}: waited {waited:.1f}s for devices other flow runs on this host lease"
            f"{' or use' if others else ''} ({self.holders_text(wanted)}{queued}{used}). Stop those flow runs"
            f"{' or programs' if others else ''}{beside} or wait longer: raise "
            f"GPU_TASKS_LEASE_TIMEOUT (now {self.lease_timeout:g}s); leases are in {str(self.lease_dir)!r} "
            "(GPU_TASKS_LEASE_DIR)"
        )


def _describe(info: dict[str, Any] | None, local_priority: bool = False, **kw: Any) -> str:
    """A holder's or waiter's info in words (``profile 'p' of this flow run`` for one of this book's)."""
    if info is None or not info.get("local"):
        return leases.describe(info, **kw)
    priority = f" (priority {int(info.get('priority') or 0)})" if local_priority else ""
    return f"profile {info.get('profile')!r} of this flow run{priority}"


def _programs_text(others: dict[str, str]) -> str:
    return "; ".join(f"device {a}: {r}" for a, r in sorted(others.items()))


class _WaitLog:
    """What a waiting ``acquire`` says, at most once per ``log_every`` seconds for each kind of wait."""

    def __init__(self, book: DeviceBook, owner: str, priority: int, wanted: list[str]) -> None:
        self.book, self.owner, self.priority, self.wanted = book, owner, priority, wanted
        self.last: dict[str, float] = {}  # kind of wait -> when it was last logged
        self.asked = False  # said (once a wait) that preemptible holders give devices back
        self.explained_at: float | None = None
        self.noted: dict[str, Any] | None = None
        self.quota_read_at: float | None = None
        self.quota_use: tuple[int, int] | None = None

    def _due(self, kind: str, now: float) -> bool:
        """Whether to log ``kind`` of wait at ``now``; records it if so."""
        last = self.last.get(kind)
        if last is not None and now - last < self.book.log_every:
            return False
        self.last[kind] = now
        return True

    def protected(self, now: float, until: float, holders: str) -> None:
        """Say that the work it could take back is protected (``min_run_time``) until ``until``."""
        if not self._due("protected", now):
            return
        logger.info(
            "profile %r (priority %d): preemptible work it could take back is inside its protected run "
            "time (min_run_time) until %s (in %.1fs): %s; it preempts then",
            self.owner,
            self.priority,
            time.strftime("%H:%M:%S", time.localtime(until)),
            max(0.0, until - now),
            holders,
        )

    def waiting(
        self,
        now: float,
        held_by: set[str],
        foreign: set[str],
        first: list[dict[str, Any]],
        quota: str | None = None,
        others: dict[str, str] | None = None,
    ) -> None:
        if others and self._due("programs", now):
            logger.info(
                "profile %r: waiting for devices that programs outside gpu-tasks use: %s; giving up after "
                "%gs (GPU_TASKS_LEASE_TIMEOUT)",
                self.owner,
                _programs_text(others),
                self.book.lease_timeout,
            )
        foreign = foreign - set(others or ())  # free of leases: the programs stand in the way (said above)
        if first and self._due("yield", now):
            logger.info(
                "profile %r (priority %d): letting waiter(s) that rank before it have devices first: %s",
                self.owner,
                self.priority,
                self.book.waiters_text(first),
            )
        if quota is not None and self._due("quota", now):
            logger.info(
                "profile %r: waiting for room in quota %r (%s); giving up after %gs "
                "(GPU_TASKS_LEASE_TIMEOUT)",
                self.owner,
                quota,
                self.book.quota_text(quota),
                self.book.lease_timeout,
            )
        if quota is not None:
            foreign = set()  # free devices: the quota is what stands in the way (said above)
        if not self._due("wait", now):
            return
        if held_by:
            # the devices those profiles hold, not all it wants: one another flow run leased was named
            # as held here (a new-user pass); a snapshot for a log line
            ours = [a for a in self.wanted if dict(self.book.holders).get(a) in held_by] or self.wanted
            logger.info(
                "profile %r: waiting for devices %s, held by profile(s) %s of this flow run; an idle one "
                "gives them back at once, a busy one once its tasks there end",
                self.owner,
                ",".join(ours),
                ", ".join(repr(h) for h in sorted(held_by)),
            )
        # read now: a device given back since (a preempted holder's, say) is no longer named as leased
        leased = self.book.holders_text(sorted(foreign), held_only=True) if foreign else ""
        if leased:
            logger.info(
                "profile %r: waiting for devices leased by other flow runs on this host: %s; "
                "giving up after %gs (GPU_TASKS_LEASE_TIMEOUT)",
                self.owner,
                leased,
                self.book.lease_timeout,
            )
