"""``gpu-tasks quotas``: list, set and delete team quotas (Prefect global concurrency limits)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Column, Table
from rich.text import Text

from gpu_tasks.cli.common import app, console, echo_json, fail, load_settings, preflight, say
from gpu_tasks.devices import fair_share, leases

quotas_app = typer.Typer(
    help="Team quotas: the most devices a quota's profiles hold at once, across flow runs, kept in "
    "Prefect global concurrency limits named gpu-quota:<name> (docs/leases.md, Quotas).",
    invoke_without_command=True,
    no_args_is_help=False,
)
app.add_typer(quotas_app, name="quotas")


# the most a Prefect concurrency limit holds (an INTEGER column: 32 bits on PostgreSQL)
MOST = 2**31 - 1


def _quota_api(what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` against the Prefect API, or exit 1 naming the API and what failed (a broken
    environment exits 2 earlier, in ``preflight``)."""
    from prefect.settings import PREFECT_API_URL

    try:
        return fn(*args)
    except Exception as exc:
        url = PREFECT_API_URL.value() or "Prefect's ephemeral API (PREFECT_API_URL unset)"
        fail(f"could not {what} at {url}: {type(exc).__name__}: {exc}", code=1)


@quotas_app.callback()
def quotas_list(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List every quota with its limit, the devices in use, its team's decayed device use on this host
    (fair share) and its share of all teams' use, and who holds its devices on this host."""
    if ctx.invoked_subcommand is not None:
        return
    from gpu_tasks.prefect_api import quotas

    settings = load_settings()
    preflight("quotas")  # a broken Prefect home or API: one line, not the ephemeral server's tracebacks
    rows = _quota_api("read the quotas", quotas.usage, leases.holders(settings.lease_dir))
    used = fair_share.read(settings.lease_dir, half_life=settings.fair_share_half_life)
    share = fair_share.shares(used)
    for row in rows:
        row["usage_device_seconds"] = round(used.get(row["quota"], 0.0), 3)
        row["share"] = round(share.get(row["quota"], 0.0), 4)
    if as_json:
        echo_json({"quotas": rows})
        return
    if not rows:
        say("No quotas: create one with `gpu-tasks quotas set NAME N` (a gpu-quota:NAME limit).")
        return
    half_life = f"half-life {settings.fair_share_half_life:g}s" if settings.fair_share_half_life else "off"
    columns = ("Quota", "Limit (devices)", "In use", "Borrowed", "Lends", "Active")
    usage = (f"Usage (device-s, {half_life})", "Share", Column("Held on this host by", overflow="fold"))
    table = Table(*columns, *usage, title="Quotas (Prefect global concurrency limits gpu-quota:<name>)")
    for row in rows:
        here = "; ".join(
            f"device {h['address']}: {leases.describe(h, with_id=False)}" for h in row["holders_here"]
        )
        table.add_row(
            Text(row["quota"]),
            str(row["limit"]),
            str(row["in_use"]),
            f"{row['borrowed']} of {row['borrowing_limit']}",
            _lends(row["lending_limit"]),
            "yes" if row["active"] else "no",
            f"{row['usage_device_seconds']:.1f}",
            f"{100 * row['share']:.0f}%",
            Text(here or "-"),
        )
    console.print(table)


@quotas_app.command(
    "set",
    help="Create a quota, or change its limit (devices held at once).",
    context_settings={"ignore_unknown_options": True},  # `set team -1` is a bad count, not an option
)
def quotas_set(
    name: Annotated[str, typer.Argument(help="The quota's name, as in a profile's quota=.")],
    devices: Annotated[int, typer.Argument(help="The most devices its profiles hold at once (>= 1).")],
    borrowing_limit: Annotated[
        int | None,
        typer.Option(
            "--borrowing-limit",
            help="Devices its preemptible profiles may borrow beyond the quota while no team owed them "
            "waits (a gpu-borrow:<name> limit; 0: none, a new quota's default; left out: unchanged).",
        ),
    ] = None,
    lending_limit: Annotated[
        int | None,
        typer.Option(
            "--lending-limit",
            help="The most of its unused quota other teams may borrow (a gpu-lend:<name> limit; "
            "a new quota's default: all of it; left out: unchanged; -1 removes the limit).",
        ),
    ] = None,
) -> None:
    from gpu_tasks.prefect_api import quotas
    from gpu_tasks.profiles import is_valid_name

    if not is_valid_name(name):
        fail(f"quota name {name!r}: use letters, digits, '_', '.', '-' (at most 63 characters)")
    if devices < 1:
        fail(
            f"devices must be at least 1 (got {devices}); `gpu-tasks quotas delete {name}` removes the quota"
        )
    if not devices <= MOST:
        fail(f"devices must be at most {MOST:,} (got {devices}), the most a Prefect concurrency limit holds")
    if borrowing_limit is not None and not 0 <= borrowing_limit <= MOST:
        fail(f"--borrowing-limit must be 0 to {MOST:,} (got {borrowing_limit})")
    if lending_limit is not None and not -1 <= lending_limit <= MOST:
        fail(f"--lending-limit must be 0 to {MOST:,}, or -1 to remove the limit (got {lending_limit})")
    load_settings()
    preflight("quotas set")
    _quota_api(f"set quota {name!r}", quotas.set_limit, name, devices)
    say(f"quota {name!r}: at most {devices} device(s) at once ({quotas.limit_name(name)})")
    if borrowing_limit is not None or lending_limit is not None:
        _quota_api(f"set quota {name!r}'s sharing", quotas.set_sharing, name, borrowing_limit, lending_limit)
    if borrowing_limit is not None:
        say(
            f"quota {name!r}: borrows at most {borrowing_limit} device(s) beyond it "
            f"({quotas.borrow_name(name)})"
        )
    if lending_limit is not None:
        lends = "all" if lending_limit < 0 else f"at most {lending_limit} device(s)"
        say(f"quota {name!r}: lends {lends} of its unused quota ({quotas.lend_name(name)})")


@quotas_app.command("delete", help="Delete a quota (profiles naming it then fail to start).")
def quotas_delete(name: Annotated[str, typer.Argument(help="The quota's name.")]) -> None:
    from gpu_tasks.prefect_api import quotas

    load_settings()
    preflight("quotas delete")
    if not _quota_api(f"delete quota {name!r}", quotas.delete_limit, name):
        fail(f"no quota {name!r} ({quotas.limit_name(name)}): gpu-tasks quotas lists them")
    say(f"quota {name!r} deleted")


def _lends(limit: int | None) -> str:
    """A quota's lending limit in the table: ``None`` lends all of its unused quota, 0 lends nothing."""
    return "all unused" if limit is None else "none" if limit == 0 else f"<= {limit}"
