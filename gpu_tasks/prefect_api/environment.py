"""Preflight: the environment Prefect runs in, checked before anything starts, each problem in one
line with its fix (docs/operations.md, "When the environment is broken")."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpu_tasks.errors import EnvironmentProblem

MIN_FREE_BYTES = 32 * 2**20  # below this where Prefect or the pipeline writes, a run fails part-way
FULL_BYTES = 4 * 2**20  # a flow on the ephemeral API is refused only for a disk this full under its database
API_TIMEOUT_S = 2.0  # one request, no retries: Prefect's client retries a dead URL for about a minute


_REVISION = re.compile(r"""^revision\s*(?::\s*str\s*)?=\s*["']([0-9A-Za-z_]+)["']""", re.MULTILINE)


@functools.cache
def _known_revisions() -> frozenset[str]:
    """The alembic revisions of Prefect's SQLite migrations, read (not imported) from its scripts;
    empty when not found (the check is skipped)."""
    try:
        from prefect.server.database.orm_models import AioSqliteORMConfiguration

        folder = Path(AioSqliteORMConfiguration().versions_dir)
    except Exception:  # another Prefect release
        return frozenset()
    texts = (script.read_text(encoding="utf-8", errors="replace") for script in folder.glob("*.py"))
    return frozenset(match.group(1) for text in texts if (match := _REVISION.search(text)))


def _write_probe(folder: Path) -> str | None:
    """Why a file cannot be created in ``folder``, or ``None``. A real write, not permission bits:
    root passes those everywhere, a read-only mount fails them all."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def home_problem(home: Path) -> str | None:
    """``PREFECT_HOME`` is not a directory this process can write (created if missing, as Prefect does)."""
    fix = (
        "set PREFECT_HOME to a directory you can write (e.g. export PREFECT_HOME=$HOME/.prefect-gpu-tasks; "
        "Prefect starts a new, empty database there)"
    )
    try:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        blocker = _existing_ancestor(home)
        why = f"{blocker} is a file, not a directory" if blocker.is_file() else exc.strerror or str(exc)
        return f"PREFECT_HOME {home} cannot be created ({why}): {fix}"
    if not home.is_dir():
        return f"PREFECT_HOME {home} is a file, not a directory: {fix}"
    denied = _write_probe(home)
    if denied is not None:
        return (
            f"PREFECT_HOME {home} is not writable ({denied}); Prefect keeps its database and results there: "
            f"{fix}, or make {home} writable"
        )
    return None


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite[+driver]:///path`` URL; ``None`` for another or an in-memory database."""
    if not url.startswith("sqlite") or ":///" not in url:
        return None
    path = url.split(":///", 1)[1].split("?", 1)[0]
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    return Path(path)


def database_problem(db: Path, home: Path) -> str | None:
    """Prefect's SQLite database is not one, not writable, or at a revision this Prefect does not know."""
    if not db.exists():
        return None  # Prefect creates it
    home_default = _database_place(db, home)[1] == "PREFECT_HOME"
    if home_default:
        elsewhere = "or set PREFECT_HOME to another directory (a new, empty database)"
    else:
        elsewhere = "or point PREFECT_SERVER_DATABASE_CONNECTION_URL at another file"
    reset = "run `prefect server database reset -y` (deletes the runs it holds)"
    if not db.is_file():
        return f"Prefect's database {db} is not a file: move it away, {elsewhere}"
    try:
        os.close(os.open(db, os.O_WRONLY))  # opened, never written
    except OSError as exc:
        owner = "" if home_default else " (PREFECT_SERVER_DATABASE_CONNECTION_URL)"
        return (
            f"Prefect's database {db}{owner} is not writable ({exc.strerror}): make it writable, {elsewhere}"
        )
    import sqlite3

    try:
        conn = sqlite3.connect(f"file:{db.absolute()}?mode=ro", uri=True, timeout=5)
        try:
            rows = conn.execute("SELECT version_num FROM alembic_version").fetchall()
        finally:
            conn.close()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return None  # an empty or new database: Prefect migrates it
        if "locked" in str(exc):
            return None  # in use by a running server: it opened it, so it knows it
        return f"Prefect's database {db} cannot be read ({exc}): {reset}, {elsewhere}"
    except sqlite3.DatabaseError as exc:
        return f"Prefect's database {db} is not a SQLite database ({exc}): {reset}, {elsewhere}"
    known = _known_revisions()
    unknown = sorted(str(r[0]) for r in rows if known and str(r[0]) not in known)
    if unknown:
        import prefect

        return (
            f"Prefect's database {db} is at schema revision {', '.join(map(repr, unknown))}, which Prefect "
            f"{getattr(prefect, '__version__', '?')} does not know (a newer Prefect upgraded it): {reset}, "
            f"{elsewhere}, or go back to the newer Prefect"
        )
    return None


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def disk_problem(places: Iterable[tuple[str, str, Path]], min_free: int = MIN_FREE_BYTES) -> str | None:
    """A place ``(what, the setting that moves it, path)`` cannot be written or has under ``min_free``
    bytes free."""
    seen: set[int] = set()
    for what, setting, path in places:
        fix = f"point {setting} at a directory you can write"
        where = _existing_ancestor(path)
        if not where.is_dir():
            return f"{what} {path} cannot be created ({where} is a file, not a directory): {fix}"
        try:
            st = os.stat(where)
            free = shutil.disk_usage(where).free
        except OSError as exc:
            return f"{what} {path}: cannot check its disk ({exc.strerror}): {fix}"
        if st.st_dev not in seen and free < min_free:
            return (
                f"only {_size(free)} free on the disk of {what} {path} (at least {_size(min_free)} needed): "
                f"free space on {where}, or point {setting} at a directory on another disk"
            )
        seen.add(st.st_dev)
        denied = _write_probe(where)
        if denied is not None:
            return f"{what} {path} is not writable ({denied} in {where}): {fix}"
    return None


def _port_holder(host: str, port: int) -> str | None:
    """Which local process listens on ``port``, where the OS says so."""
    if host not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return None
    with contextlib.suppress(Exception):  # psutil.AccessDenied on some systems for other users' sockets
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                try:
                    proc = psutil.Process(conn.pid)
                    command = " ".join(" ".join(proc.cmdline()).split())  # one line, however it was typed
                    return f"{proc.name()} (pid {conn.pid}: {command[:100]})"
                except psutil.Error:
                    return f"pid {conn.pid}"
    return None


def _as_prefects_client() -> dict[str, Any]:
    """The credentials and TLS verification Prefect's client would use (its settings)."""
    import ssl

    from prefect.settings import get_current_settings

    from gpu_tasks.prefect_api.api import api_headers

    api = get_current_settings().api
    verify: bool | ssl.SSLContext = True
    if api.tls_insecure_skip_verify:
        verify = False
    elif api.ssl_cert_file:
        verify = ssl.create_default_context(cafile=api.ssl_cert_file)
    return {"headers": api_headers(), "verify": verify}


def api_problem(url: str, command: str, timeout: float = API_TIMEOUT_S) -> str | None:
    """``PREFECT_API_URL`` does not answer as a Prefect API: one ``GET /health``, no retries."""
    import httpx

    unset = f", or unset PREFECT_API_URL (gpu-tasks {command} starts its own)"
    if command.endswith("serve"):  # `example serve` needs a server of yours
        unset = ""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        port = 0
    if parts.scheme not in ("http", "https") or not parts.hostname or not port:
        return (
            f"PREFECT_API_URL {url!r} is not an http(s) URL of a server: set it to one such as "
            f"http://127.0.0.1:4200/api{unset}"
        )
    host = parts.hostname
    fix = f"start it (`prefect server start --host 127.0.0.1 --port {port}`){unset}"
    free_port = (
        "run Prefect on a free port (`prefect server start --host 127.0.0.1 --port <free port>`) and point "
        f"PREFECT_API_URL there{unset}"
    )
    health = url.rstrip("/") + "/health"
    try:
        reply = httpx.get(health, timeout=timeout, **_as_prefects_client())
    except httpx.TimeoutException:
        holder = _port_holder(host, port)
        held = f"port {port} is held by {holder}" if holder else f"something holds {host}:{port}"
        return (
            f"PREFECT_API_URL {url} does not answer within {timeout:g} s: {held}, not a Prefect server that "
            f"answers: stop it, or {free_port}"
        )
    except httpx.ConnectError as exc:
        text = str(exc).lower()
        if "ssl" in text or "certificate" in text:
            return None  # Prefect's client has its own TLS settings; let it judge
        return f"nothing answers at PREFECT_API_URL {url} ({exc or 'connection refused'}): {fix}"
    except httpx.HTTPError as exc:
        return f"cannot reach PREFECT_API_URL {url} ({type(exc).__name__}: {exc}): {fix}"
    if reply.status_code == 404:
        holder = _port_holder(host, port)
        by = f"{holder}; " if holder else ""
        return (
            f"PREFECT_API_URL {url} is answered by something that is not a Prefect API ({by}HTTP 404 for "
            f"{health}): check the URL (a Prefect server's ends in /api) and the port, or {free_port}"
        )
    return None


def _settings() -> tuple[Path, str | None, str, bool, Path]:
    """PREFECT_HOME, PREFECT_API_URL, the database URL, ephemeral servers allowed, result storage."""
    from prefect.settings import get_current_settings

    s = get_current_settings()
    secret = s.server.database.connection_url
    db_url = secret.get_secret_value() if secret is not None else f"sqlite:///{s.home}/prefect.db"
    api = str(s.api.url) if s.api.url else None
    return Path(s.home), api, db_url, bool(s.server.ephemeral.enabled), Path(s.results.local_storage_path)


def _database_place(db: Path, home: Path) -> tuple[str, str, Path]:
    default = db.absolute() == (home / "prefect.db").absolute()
    setting = "PREFECT_HOME" if default else "PREFECT_SERVER_DATABASE_CONNECTION_URL"
    return ("Prefect's database", setting, db.absolute().parent)


def local_problems(data_dir: Path | None = None) -> list[str]:
    """The problems found without the network: home, the database a server started here would open,
    free space where Prefect and the pipeline (``data_dir``) write."""
    home, api, db_url, _, storage = _settings()
    problem = home_problem(home)
    if problem is not None:
        return [problem]  # the rest lives under it
    problems: list[str | None] = []
    places = [("Prefect's result storage", "PREFECT_RESULTS_LOCAL_STORAGE_PATH", storage)]
    db = sqlite_path(db_url) if api is None else None
    if db is not None:  # a server started here opens that database and writes beside it
        problems.append(database_problem(db, home))
        places.insert(0, _database_place(db, home))
    if data_dir is not None:
        places.append(("the pipeline's data directory", "--data-dir or GPU_TASKS_DATA_DIR", data_dir))
    problems.append(disk_problem(places))
    return [p for p in problems if p is not None]


def preflight(command: str, data_dir: Path | None = None) -> None:
    """Every check for ``gpu-tasks <command>`` before it starts anything: ``EnvironmentProblem``, the
    first problem found."""
    problems = local_problems(data_dir)
    if problems:
        raise EnvironmentProblem(problems[0])
    _, api, _, _, _ = _settings()
    if api is not None:
        problem = api_problem(api, command)
        if problem is not None:
            raise EnvironmentProblem(problem)


_checked: dict[tuple[str, str], str | None] = {}
_lock = threading.Lock()


def check_ephemeral() -> None:
    """On Prefect's ephemeral API: ``EnvironmentProblem`` at once when its server could not open its
    home or database, instead of after minutes of retries. Once per process and settings."""
    home, api, db_url, ephemeral, _ = _settings()
    if api is not None or not ephemeral:
        return
    key = (str(home), db_url)
    with _lock:
        if key not in _checked:
            problem = home_problem(home)
            db = sqlite_path(db_url)
            if problem is None and db is not None:
                problem = database_problem(db, home) or disk_problem([_database_place(db, home)], FULL_BYTES)
            _checked[key] = problem
        problem = _checked[key]
    if problem is not None:
        raise EnvironmentProblem(problem)
