"""``stalwart ls RUN|URL``: every checkpoint of a run, committed or not, with its state and cost.

For a run with a durable tier, ``events.jsonl`` also says which steps reached it;
given a URL, ``ls`` lists the durable tier itself.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any, TextIO

from rich.text import Text

from stalwart import catalog
from stalwart.catalog import StepInfo
from stalwart.cli.common import (
    EXIT_BAD,
    EXIT_OK,
    UsageError,
    format_bytes,
    format_mapping,
    format_seconds,
    format_time,
    is_url,
    iso_utc,
    listing_error,
    make_console,
    new_table,
    open_tier,
    progress_bar,
    read_history,
    run_directory,
    store_error,
)
from stalwart.cli.timeline import INCIDENT_EVENTS, describe_incident
from stalwart.errors import DurableStoreError
from stalwart.events import read_events
from stalwart.history import DurableHistory, RunHistory
from stalwart.redact import redact_url
from stalwart.rollback import list_set_aside
from stalwart.storage.durable import DurableTier

__all__ = ["add_parser", "list_run", "list_store", "run"]

EPILOG = """\
statuses:
  committed   has a valid MANIFEST.json and every file has the size it lists
              (with --verify: and the checksum, and DCP metadata that loads safely)
  incomplete  a save in progress or abandoned by a crash (.step_*.tmp-*), or being
              deleted; never restored
  corrupt     a committed checkpoint that fails the check above, or one that restore
              moved aside (.step_*.corrupt-*) after it failed verification

resumed (the exact-resume certificate, from events.jsonl):
  exact to K       the last resume from this checkpoint redid the lost steps
                   through K and every fingerprint (loss, batch, RNG) matched
  DIVERGED at K    step K of the resume differed from the lost run (see
                   events.jsonl's resume_diverged for the rank and the likely cause)
  unverified       nothing to compare (no lost step recorded, or another world size)
  unchecked        restored, but no verdict recorded (an older stalwart, or a run
                   still redoing its steps)
  rollback         restored by stalwart.Guard's rollback (not a resume: not judged)

incidents (from events.jsonl, under the table):
  guard            a step stalwart.Guard skipped or rolled back, why, on which
                   rank, and the sample window a rollback skipped
  guard_limit      the guard gave up: too many bad steps within its window
  watchdog         a rank made no progress for the watchdog's timeout; its thread
                   stacks are in the file named (watchdog/rank<r>-<ns>.txt)

at risk (from events.jsonl's recovery_point):
  the steps of training covered by no durable checkpoint when this step's save
  began: what a failure at that moment cost (every_steps="auto" keeps it small)

durable tier:
  For a run whose manager has durable=URL, the "durable" column says whether a
  step reached the durable tier (uploaded, and not deleted by durable retention,
  according to events.jsonl), and the summary names the newest durable step, its
  upload lag, and the committed steps not yet durable.
  RUN may also be the URL itself (s3://bucket/prefix, gs://..., az://...,
  file:///...): ls then lists the store, committed steps (checked: each data
  object exists with the manifest's size) and incomplete uploads (no
  MANIFEST.json yet). Credentials come from the environment (AWS_*, ...).

exit status:
  0  the run was listed and no committed checkpoint failed its check
  1  a committed checkpoint failed the size check (or, with --verify, the checksum)
  2  usage error: RUN is missing, is a file, or is not a run directory; the store
     at URL cannot be listed (missing bucket, denied access, unreachable)
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "ls",
        help="list the checkpoints of a run",
        description=textwrap.fill(
            "List every checkpoint of a run directory, oldest step first: status, "
            "creation time, size, world size, metrics, save timings (from events.jsonl) "
            "and whether it reached the durable tier. Without --verify only sizes are "
            "checked, which reads no file content. Given a URL, list the durable tier there.",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "run",
        metavar="RUN",
        help="run directory (the one given to CheckpointManager), or a durable tier URL "
        "(s3://bucket/prefix)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also checksum every file of each committed checkpoint (reads all their bytes)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    if is_url(args.run):
        if args.verify:
            raise UsageError(
                f"--verify checksums local files and is not available for a URL "
                f"({redact_url(args.run)}); "
                "ls checks that every object has its manifest's size, and a restore checks the "
                "checksums of what it downloads"
            )
        report = list_store(open_tier(args.run))
        if args.json:
            out.write(json.dumps(report, indent=2, allow_nan=True) + "\n")
        else:
            _render_store(report, out)
        return EXIT_BAD if report["counts"]["corrupt"] else EXIT_OK
    directory = run_directory(
        args.run,
        lambda run: f"`ls` lists a run; try `stalwart inspect {args.run}`, or `stalwart ls {run}`",
    )
    report = list_run(directory, verify=args.verify, warn=err)
    if args.json:
        out.write(json.dumps(report, indent=2, allow_nan=True) + "\n")
    else:
        _render(report, out)
    failed = any(e["status"] == "corrupt" and e["checked"] is not None for e in report["entries"])
    return EXIT_BAD if failed else EXIT_OK


def list_run(run: Path, *, verify: bool, warn: TextIO) -> dict[str, Any]:
    """The ``--json`` report: run, verified, latest_step, counts and one entry per checkpoint."""
    history = read_history(run, warn)
    try:
        infos = catalog.list_run(run, skip_reasons=history.skip_reasons)
    except OSError as exc:
        raise listing_error(run, exc) from None
    total = sum(
        i.manifest.total_bytes for i in infos if i.status == "committed" and i.manifest is not None
    )
    rows: list[dict[str, Any]] = []
    with progress_bar(total if verify else 0, "verifying") as advance:
        for info in infos:
            catalog.check_step(info, checksums=verify, advance=advance)
            rows.append(_local_row(info, history))
    durable = history.durable
    durable_steps = durable.steps
    verdicts = _resume_verdicts(run)
    incidents = _incidents(run)
    rolled_back = {i["restored_step"] for i in incidents if i["action"] == "rollback"}
    for row in rows:
        row["resume"] = _resume_entry(verdicts, row["step"], rolled_back)
        row["durable"] = (
            None if durable.url is None or row["step"] is None else row["step"] in durable_steps
        )
    counts = _counts(rows)
    committed = [r["step"] for r in rows if r["status"] == "committed"]
    return {
        "run": str(run),
        "verified": verify,
        "latest_step": max(committed) if committed else None,
        "counts": counts,
        "durable": _durable_summary(durable, committed, rows),
        "entries": rows,
        "resumes": [
            {"restored_step": step, **(_resume_entry(verdicts, step, rolled_back) or {})}
            for step in sorted(verdicts)
        ],
        "incidents": incidents,
        "set_aside": [
            {"path": a.name, "to": a.to, "steps": a.steps, "time": iso_utc(a.mtime)}
            for a in list_set_aside(run)
        ],
    }


def _incidents(run: Path) -> list[dict[str, Any]]:
    """Guard decisions and watchdog firings, oldest first, each with its one-line message."""
    try:
        records = [r for r in read_events(run) if r.get("event") in INCIDENT_EVENTS]
    except OSError:
        return []  # read_history has warned already
    return [
        {
            "time": _event_time(r),
            "event": r["event"],
            "rank": r.get("rank"),
            "step": r.get("step"),
            "action": r.get("action"),
            "restored_step": _step_or_none(r.get("restored_step")),
            "message": describe_incident(r),
        }
        for r in records
    ]


def _step_or_none(value: Any) -> int | None:
    """A step number from an event, or None: events.jsonl is input from outside."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _resume_verdicts(run: Path) -> dict[int, Any]:
    try:
        return dict(catalog.resume_verdicts(run))
    except OSError:
        return {}  # read_history has warned already


def _resume_entry(
    verdicts: dict[int, Any], step: int | None, rolled_back: set[Any]
) -> dict[str, Any] | None:
    """The exact-resume certificate of the last restore from ``step`` (None: never restored).

    A restore without a verdict that a guard rollback made is marked ``rollback``:
    the certificate does not judge a deliberate rollback.
    """
    if step is None or step not in verdicts:
        return None
    record = verdicts[step]
    return {
        "verdict": None if record is None else record.get("event"),
        "mark": "rollback"
        if record is None and step in rolled_back
        else catalog.verdict_mark(record),
        "message": None if record is None else record.get("message"),
    }


def _counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts = {status: 0 for status in ("committed", "incomplete", "corrupt")}
    for row in rows:
        counts[row["status"]] += 1
    return counts


def _durable_summary(
    durable: DurableHistory, committed: list[int], rows: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The ``durable`` object of the report: None when the run never had a durable tier."""
    if durable.url is None:
        return None
    last = durable.last_step
    upload = durable.upload_of(last) if last is not None else None
    lag = upload.get("lag_s") if upload is not None else None
    local = {r["step"] for r in rows if r["step"] is not None}
    unreachable = durable.unreachable
    return {
        "url": durable.url,
        "last_durable_step": last,
        "lag_s": float(lag) if isinstance(lag, (int, float)) else None,
        "uploaded": None if upload is None else _event_time(upload),
        "durable_steps": sorted(durable.steps),
        "not_durable_steps": sorted(s for s in committed if last is None or s > last),
        "durable_only_steps": sorted(durable.steps - local),
        "upload_failures": [
            {
                "step": f.get("step"),
                "error": f.get("error"),
                "will_retry": f.get("will_retry"),
                "time": _event_time(f),
            }
            for f in durable.failures
        ],
        "unreachable": None
        if unreachable is None
        else {"error": unreachable.get("error"), "time": _event_time(unreachable)},
        "behind_at_close": durable.behind,
    }


def _event_time(record: dict[str, Any]) -> str | None:
    when = record.get("time")
    # iso_utc, not float(): an int beyond floats in a crafted event must not stop ls.
    return iso_utc(when) if isinstance(when, (int, float)) else None


# ----------------------------------------------------------------- the durable tier


def list_store(tier: DurableTier) -> dict[str, Any]:
    """The ``--json`` report of ``ls URL``: one entry per step prefix in the store.

    One listing gives every object with its size; each committed step costs one
    more GET (its manifest), fetched in parallel. No data object is read.
    """
    try:
        infos = catalog.list_store(tier)
    except (DurableStoreError, FileNotFoundError) as exc:
        raise store_error(exc) from None
    rows = [_store_row(info) for info in infos]
    counts = _counts(rows)
    good = [r["step"] for r in rows if r["status"] == "committed"]
    return {
        "url": tier.url,
        "verified": False,
        "latest_step": max(good) if good else None,
        "counts": counts,
        "stored_bytes": sum(i.stored_bytes or 0 for i in infos),
        "entries": rows,
    }


def _row(info: StepInfo) -> dict[str, Any]:
    """The fields every ``entries`` item has, from what the catalog found."""
    manifest = info.manifest
    modified = info.modified
    return {
        "name": info.name,
        "path": info.path,
        "step": info.step,
        "status": info.status,
        "checked": info.checked,
        "problems": [p.to_dict() for p in info.problems],
        "created": manifest.created
        if manifest is not None
        else (None if modified is None else iso_utc(modified)),
        "created_unix": manifest.created_unix if manifest is not None else modified,
        "bytes": info.bytes,
        "files": info.files,
        "world_size": None if manifest is None else manifest.world_size,
        "epoch": None if manifest is None else manifest.epoch,
        "metrics": {} if manifest is None else manifest.metrics,
    }


def _store_row(info: StepInfo) -> dict[str, Any]:
    row = _row(info)
    row.update(objects=info.objects, stored_bytes=info.stored_bytes)
    return row


def _local_row(info: StepInfo, history: RunHistory) -> dict[str, Any]:
    row = _row(info)
    row["timings"] = history.timings.get(info.step) if info.step is not None else None
    row["steps_at_risk"] = history.at_risk.get(info.step) if info.step is not None else None
    return row


_STATUS_STYLE = {"committed": "green", "incomplete": "yellow", "corrupt": "bold red"}


def _render(report: dict[str, Any], out: TextIO) -> None:
    console = make_console(out)
    entries = report["entries"]
    durable = report["durable"]
    if not entries:
        console.print(f"{report['run']}: no checkpoints", markup=False, soft_wrap=True)
        _print_set_aside(console, report)
        if durable is not None:
            for line in _durable_lines(durable):
                console.print(line, markup=False, soft_wrap=True)
        return
    console.print(f"run {report['run']}", markup=False, soft_wrap=True)
    columns = ["step", "status", "durable"] if durable is not None else ["step", "status"]
    table = new_table(
        *columns,
        "created",
        "size",
        "files",
        "world",
        "stall",
        "write",
        "at risk",
        "resumed",
        "metrics",
        right=("step", "size", "files", "world", "stall", "write", "at risk"),
        wrap=("created", "metrics"),
    )
    for e in entries:
        timings = e["timings"] or {}
        cells: list[str | Text] = [
            "-" if e["step"] is None else str(e["step"]),
            Text(e["status"], style=_STATUS_STYLE[e["status"]]),
        ]
        if durable is not None:
            cells.append(_DURABLE_MARK[e["durable"]])
        table.add_row(
            *cells,
            format_time(e["created_unix"]),
            format_bytes(e["bytes"]),
            "-" if e["files"] is None else str(e["files"]),
            "-" if e["world_size"] is None else str(e["world_size"]),
            format_seconds(timings.get("stall_s")),
            format_seconds(timings.get("write_s")),
            "-" if e.get("steps_at_risk") is None else str(e["steps_at_risk"]),
            _resume_cell(e.get("resume")),
            Text(format_mapping(e["metrics"])),
        )
    console.print(table)
    _print_problems(console, entries)
    _print_counts(console, report)
    for resume in report.get("resumes", []):
        text = resume["message"] or f"{resume['mark']} (no verdict recorded)"
        console.print(
            f"restored step {resume['restored_step']}: {text}", markup=False, soft_wrap=True
        )
    for incident in report.get("incidents", []):
        console.print(
            f"{incident['event']} at step {incident['step']}: {incident['message']}",
            markup=False,
            soft_wrap=True,
        )
    _print_set_aside(console, report)
    if durable is not None:
        for line in _durable_lines(durable):
            console.print(line, markup=False, soft_wrap=True)
    console.print(
        "checked: sizes and checksums"
        if report["verified"]
        else "checked: sizes only (use --verify to checksum every file)",
        markup=False,
        soft_wrap=True,
    )


_DURABLE_MARK = {True: "yes", False: "no", None: "-"}


def _print_set_aside(console: Any, report: dict[str, Any]) -> None:
    for aside in report.get("set_aside", []):
        steps = ", ".join(map(str, aside["steps"])) or "no steps"
        console.print(
            f"set aside by a rollback to step {aside['to'] if aside['to'] is not None else '?'}: "
            f"{steps}, in {_printable(aside['path'])}/ (rename a step back into the run to "
            "use it again)",
            markup=False,
            soft_wrap=True,
        )


def _printable(name: str) -> str:
    """``name`` with control characters (a terminal's escapes) shown as ``\\xNN``."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in name)


def _resume_cell(resume: dict[str, Any] | None) -> Text:
    """The "resumed" column: the certificate of the last resume from this checkpoint."""
    if resume is None:
        return Text("-")
    style = {"resume_verified": "green", "resume_diverged": "bold red"}.get(resume["verdict"], "")
    return Text(resume["mark"], style=style)


def _print_problems(console: Any, entries: list[dict[str, Any]]) -> None:
    for e in entries:
        for p in e["problems"]:
            where = e["name"] if p["file"] is None else f"{e['name']}/{p['file']}"
            console.print(f"{where}: {p['reason']}", markup=False, soft_wrap=True)


def _print_counts(console: Any, report: dict[str, Any]) -> None:
    counts = report["counts"]
    latest = report["latest_step"]
    console.print(
        f"newest committed step: {'none' if latest is None else latest}; "
        f"{counts['committed']} committed, {counts['incomplete']} incomplete, "
        f"{counts['corrupt']} corrupt",
        markup=False,
        soft_wrap=True,
    )


def _steps(steps: list[int], limit: int = 10) -> str:
    shown = ", ".join(map(str, steps[-limit:]))
    return shown if len(steps) <= limit else f"..., {shown}"


def _durable_lines(durable: dict[str, Any]) -> list[str]:
    """The summary of the durable tier under the table, one fact a line."""
    last = durable["last_durable_step"]
    if last is None:
        head = f"durable tier {durable['url']}: no step uploaded yet"
    else:
        lag = durable["lag_s"]
        head = f"durable tier {durable['url']}: newest durable step {last}" + (
            "" if lag is None else f" (uploaded {format_seconds(lag)} after its commit)"
        )
    pending = durable["not_durable_steps"]
    lines = [
        head
        + f"; {len(pending)} committed step{'' if len(pending) == 1 else 's'} not yet durable"
        + (f" ({_steps(pending)})" if pending else "")
    ]
    if durable["durable_only_steps"]:
        lines.append(
            "durable only (no longer on local disk): " + _steps(durable["durable_only_steps"])
        )
    for f in durable["upload_failures"]:
        retry = "will retry" if f["will_retry"] else "gave up"
        lines.append(f"upload of step {f['step']} failed ({retry}): {f['error']}")
    if durable["unreachable"] is not None:
        u = durable["unreachable"]
        lines.append(f"durable tier unreachable at {u['time'] or '?'}: {u['error']}")
    if durable["behind_at_close"]:
        lines.append(
            "not uploaded when the manager closed (the next run uploads them): "
            + _steps(durable["behind_at_close"])
        )
    return lines


def _render_store(report: dict[str, Any], out: TextIO) -> None:
    console = make_console(out)
    entries = report["entries"]
    if not entries:
        console.print(f"{report['url']}: no checkpoints", markup=False, soft_wrap=True)
        return
    console.print(f"durable tier {report['url']}", markup=False, soft_wrap=True)
    table = new_table(
        "step",
        "status",
        "created",
        "size",
        "objects",
        "world",
        "metrics",
        right=("step", "size", "objects", "world"),
        wrap=("created", "metrics"),
    )
    for e in entries:
        table.add_row(
            str(e["step"]),
            Text(e["status"], style=_STATUS_STYLE[e["status"]]),
            format_time(e["created_unix"]),
            format_bytes(e["bytes"]),
            str(e["objects"]),
            "-" if e["world_size"] is None else str(e["world_size"]),
            Text(format_mapping(e["metrics"])),
        )
    console.print(table)
    _print_problems(console, entries)
    _print_counts(console, report)
    console.print(
        f"stored: {format_bytes(report['stored_bytes'])}; checked: every object's size "
        "(a restore checksums what it downloads)",
        markup=False,
        soft_wrap=True,
    )
