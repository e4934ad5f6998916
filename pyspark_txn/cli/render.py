"""How the commands print what the operations return: snapshot lines, progress bars,
named-snapshot lines. No argument parsing here, and no decisions."""

from __future__ import annotations

import sys

from ..operations.handle import DELTA, POSTGRES, target_terms
from ..operations.repair import SnapshotStatus


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
