"""How the commands print what the operations return: snapshot lines, progress bars,
named-snapshot lines. No argument parsing here, and no decisions."""

from __future__ import annotations

import sys

from ..operations.handle import (
    DELTA,
    POSTGRES,
    describe_not_started,
    describe_origin,
    target_terms,
)
from ..operations.repair import SnapshotStatus
from ..operations.status import LightSinkStatus, NotStartedStatus


def describe(status: SnapshotStatus) -> list[str]:
    d = status.to_json()
    terms = status.terms or target_terms(None)
    lines = [f"snapshot {d['snapshot_id']} of sink {d['sink_id']}: {d['state']}"]
    if status.record is not None:
        lines.append(
            f"  batch {d['batch_id']}, {d['rows']} rows in {d['files']} {terms.txns} "
            f"({d['bytes']} bytes), recorded {d['created_at']} by run {d['run_id']}"
        )
        lines += txn_lines(status, terms)
        if d["target_error"]:
            lines.append(f"  target: cannot be read: {d['target_error']}")
        elif status.target_gone is not None:
            lines.append(f"  target: {status.target_gone}")
            lines.append(f"  {gone_restart(status)}")
        elif d["target_batch"] is None:
            lines.append("  target holds no batch of this sink (or does not exist)")
        else:
            lines.append(f"  target holds this sink's batches up to {d['target_batch']}")
    else:
        lines += txn_lines(status, terms)
    return lines


def gone_restart(status: SnapshotStatus) -> str:
    """What a restart does where the table is gone (the sink refuses: TargetGoneError)."""
    return (
        f"The record table says {status.lost_batches}. A restart of the query refuses "
        "to write, as writing on would leave those batches out of the table: restore the table where it was (with its "
        "_delta_log), or start over with a new checkpoint (its source is read from the start)"
    )


def txn_lines(status: SnapshotStatus, terms) -> list[str]:
    if not status.txn_states:
        return []
    states = list(status.txn_states.values())
    counts = ", ".join(f"{states.count(k)} {k}" for k in TXN_STATES)
    lines = [f"  its {terms.txns}: {counts}"]
    return lines + [f"    {gid}: {st}" for gid, st in sorted(status.txn_states.items())]


TXN_STATES = ("prepared", "committed", "missing")


def holds(batch: int | None) -> str:
    if batch is None:
        return "holds no batch of this sink"
    return f"holds this sink's batches up to {batch}"


CANNOT_SUCCEED = {
    POSTGRES: "a prepared transaction is gone, rolled back outside the sink",
    DELTA: "files lost, target dropped or altered",
}


def progress_bar(desc: str = "verify"):
    """A tqdm progress callback when tqdm is installed and stderr is a terminal."""
    if not sys.stderr.isatty():
        return None, lambda: None
    try:
        from tqdm import tqdm
    except ImportError:
        return None, lambda: None
    bars: list = []  # made at the first call, when the total is known

    def progress(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr))
        bars[0].update(done - bars[0].n)

    def close() -> None:
        if bars:
            bars[0].close()

    return progress, close


def named_lines(n) -> list[str]:
    d = n.details
    return [
        f"{n.name}: snapshot {n.snapshot_id}, batch {n.batch_id} (sink snapshot "
        f"{n.of_snapshot_id}, table version {n.target_version}), created "
        f"{n.created_at.isoformat() if n.created_at else '?'}",
        f"  {d.get('rows')} rows in {len(d.get('files', []))} files ({d.get('bytes')} bytes) "
        f"at {n.location}",
    ]


def request_json(r) -> dict:
    return {**r.to_json(), "state": "requested"}


def _ago(seconds: float | None) -> str:
    return "" if seconds is None else f", {seconds:.0f} s ago"


def light_status_lines(status: LightSinkStatus) -> list[str]:
    """``pyspark-txn status`` of a mode=light sink."""
    d = status.to_json()
    verdict = "healthy" if status.healthy else "NEEDS ATTENTION"
    lines = [f"sink {status.sink_id} (mode=light): {verdict}"]
    if status.started_from is not None:
        started = status.started_from
        lines.append(f"  {describe_origin(started)} at batch {started.get('batch_id')}")
    if status.last_commit is not None:
        query = f", query {d['last_query_id']}" if d["last_query_id"] else ""
        lines.append(
            f"  last batch {d['last_batch']} committed {d['last_committed_at']}"
            f"{_ago(status.lag_seconds)} (table version {d['last_version']}{query})"
        )
    elif status.target_batch is not None:
        lines.append(
            f"  last batch {status.target_batch} (the table's app transaction; none of its "
            "last 1,000 commits is this sink's, so when is not known)"
        )
    planned, committed = status.spark_planned_batch, status.spark_committed_batch
    if planned is None:
        lines.append("  Spark's checkpoint: no batch planned yet")
    else:
        age = status.planned_seconds_ago
        lines.append(
            f"  Spark's checkpoint: batch {planned} planned"
            + ("" if age is None else f" {age:.0f} s ago")
            + ", "
            + ("no batch committed" if committed is None else f"batch {committed} committed")
        )
    uri = status.target_uri
    if uri is None:
        lines.append(
            "  target: not known: a mode=light checkpoint does not name its Delta table; "
            "pass --target URI to see the batches it holds"
        )
    elif status.target_error:
        lines.append(f"  target {uri}: cannot be read: {status.target_error}")
    elif not status.target_exists:
        lines.append(f"  target {uri}: no table")
    else:
        lines.append(
            f"  target {uri}: version {status.target_version}, {holds(status.target_batch)}"
        )
    lines += [f"  {note}" for note in status.notes]
    lines += [f"  problem: {problem}" for problem in status.problems]
    lines.append(
        "  a light sink keeps no record table: records, stuck, abandon, verify and named "
        "snapshots do not apply to it (docs/modes.md)"
    )
    return lines


def not_started_lines(status: NotStartedStatus) -> list[str]:
    """``pyspark-txn status`` of a checkpoint made by prepare-query or a restore, before
    its query's first commit."""
    started = status.started_from
    head = (
        f"checkpoint {status.checkpoint}: {status.origin}, "
        f"{describe_not_started(status.next_batch, status.sink_id is not None)}"
    )
    lines = [head if status.healthy else f"{head}; NEEDS ATTENTION"]
    version = started.get("target_version")
    lines.append(
        f"  snapshot {started.get('name')!r} of {started.get('from') or 'a query'}: batch "
        f"{started.get('batch_id')}"
        + ("" if version is None else f", table version {version}")
        + (f", created {started['created_at']}" if started.get("created_at") else "")
    )
    planned, committed = status.spark_planned_batch, status.spark_committed_batch
    lines.append(
        "  Spark's checkpoint: "
        + ("no batch planned" if planned is None else f"batch {planned} planned")
        + ", "
        + ("no batch committed" if committed is None else f"batch {committed} committed")
    )
    if status.sink_id is not None:
        lines.append(f"  sink {status.sink_id} (mode={status.mode}): no batch committed yet")
    lines += [f"  problem: {problem}" for problem in status.problems]
    return lines
