"""pyspark-txn: run the demo, and watch, repair and verify txn-delta and txn-postgres
sinks (and snapshot txn-delta ones) from a shell, without Spark."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import shutil
import sys
from typing import NoReturn

from . import _backups_cli, admin, storage
from .errors import ConfigError, TxnError


def _print_records(record_table: str, sink: str | None = None) -> None:
    from .state import DeltaEventLog, RecordStore

    store = RecordStore(DeltaEventLog(record_table, storage.current().for_delta()))
    for sink_id in [sink] if sink else admin.sink_streams(store):
        events = store.events(sink_id)
        state = store.load_sink(sink_id)
        rec = state.execution_record
        meta = admin.recorded_target(store, sink_id, state)
        terms = admin.target_terms(admin.target_kind(meta))
        print(f"sink {sink_id}")
        print(f"  target: {admin.describe_target(meta)}")
        print(
            f"  execution record: epoch={rec.epoch} snapshot_id={rec.snapshot_id} "
            f"ongoing_snapshot_id={rec.ongoing_snapshot_id} query={rec.query_id or '-'}"
        )
        # The last record's phase 2 is confirmed by the next record (or by recovery), so
        # "confirmed" trails the last recorded batch by one while a query runs.
        last = state.last_record
        confirmed = rec.last_committed_batch_id
        print(
            f"  last recorded batch: {last.batch_id if last else 'none'}; phase 2 confirmed "
            "in the record table "
            + ("for no batch yet" if confirmed is None else f"through batch {confirmed}")
            + " (`pyspark-txn status` asks the target itself)"
        )
        print(
            f"  {'seq':>4} {'event':<10} {'epoch':>5} {'snapshot':>8} {'batch':>5} {'rows':>8}  details"
        )
        for e in events:
            rows = e.payload.get("rows", "")
            detail = ""
            if e.kind.value == "snapshot":
                detail = (
                    f"{len(e.payload['txns'])} {terms.txns}, offsets {e.payload['source_offsets']}"
                )
                confirms = sorted(int(k) for k in e.payload.get("confirms") or {})
                if confirms:
                    detail += f"; confirms phase 2 of snapshot {', '.join(map(str, confirms))}"
            elif e.kind.value == "summary":
                detail = (
                    f"history of {e.payload.get('summarized_events')} events summarized: "
                    f"{len(e.payload.get('records', []))} records, "
                    f"{len(e.payload.get('named', []))} named snapshots kept"
                )
            elif e.kind.value == "named":
                detail = f"named snapshot {e.payload.get('name')!r} at {e.payload.get('location')}"
            elif e.kind.value == "name_deleted":
                detail = f"named snapshot {e.payload.get('name')!r} deleted"
            elif e.kind.value == "committed":
                detail = terms.committed_as(e.payload.get("target_version"))
            elif e.kind.value == "epoch":
                detail = f"run {e.payload.get('owner')}"
            elif e.kind.value == "abandoned":
                detail = f"reason: {e.payload.get('reason')}"
            print(
                f"  {e.seq:>4} {e.kind.value:<10} {e.epoch:>5} "
                f"{'' if e.snapshot_id is None else e.snapshot_id:>8} "
                f"{'' if e.batch_id is None else e.batch_id:>5} {rows:>8}  {detail}"
            )


def cmd_records(args: argparse.Namespace) -> int:
    record_table, _ = admin.find_record_table(args.location)
    _print_records(record_table, args.sink)
    return 0


def _describe(status: admin.SnapshotStatus) -> list[str]:
    d = status.to_json()
    terms = status.terms or admin.target_terms(None)
    lines = [f"snapshot {d['snapshot_id']} of sink {d['sink_id']}: {d['state']}"]
    if status.record is not None:
        lines.append(
            f"  batch {d['batch_id']}, {d['rows']} rows in {d['files']} {terms.txns} "
            f"({d['bytes']} bytes), recorded {d['created_at']} by run {d['run_id']}"
        )
        lines += _txn_lines(status, terms)
        if d["target_error"]:
            lines.append(f"  target: cannot be read: {d['target_error']}")
        elif status.target_gone is not None:
            lines.append(f"  target: {status.target_gone}")
            lines.append(f"  {_gone_restart(status)}")
        elif d["target_batch"] is None:
            lines.append("  target holds no batch of this sink (or does not exist)")
        else:
            lines.append(f"  target holds this sink's batches up to {d['target_batch']}")
    else:
        lines += _txn_lines(status, terms)
    return lines


def _gone_restart(status: admin.SnapshotStatus) -> str:
    """What a restart does where the table is gone (the sink refuses: TargetGoneError)."""
    return (
        f"The record table says {status.lost_batches}. A restart of the query refuses "
        "to write, as writing on would leave those batches out of the table: restore the table where it was (with its "
        "_delta_log), or start over with a new checkpoint (its source is read from the start)"
    )


def _txn_lines(status: admin.SnapshotStatus, terms) -> list[str]:
    if not status.txn_states:
        return []
    states = list(status.txn_states.values())
    counts = ", ".join(f"{states.count(k)} {k}" for k in _TXN_STATES)
    lines = [f"  its {terms.txns}: {counts}"]
    return lines + [f"    {gid}: {st}" for gid, st in sorted(status.txn_states.items())]


_TXN_STATES = ("prepared", "committed", "missing")


def _open(args: argparse.Namespace) -> admin.SinkHandle:
    """The sink of a command that reads its target (``--url``, ``--password-file``)."""
    return admin.open_sink(args.location, args.sink, url=args.url, password_file=args.password_file)


def cmd_status(args: argparse.Namespace) -> int:
    status = admin.sink_status(_open(args))
    d = status.to_json()
    if args.json:
        print(json.dumps(d, indent=2))
        return 0 if status.healthy else 1
    verdict = "healthy" if status.healthy else "NEEDS ATTENTION"
    if status.healthy and status.open_attempts:
        verdict = "healthy, with a batch in flight or left unfinished"
    elif status.healthy and status.open_exports:
        verdict = "healthy, with an export running or left unfinished"
    print(f"sink {d['sink_id']}: {verdict}")
    if status.failed_attempt:
        print(
            f"  failed: Spark planned batch {d['spark_planned_batch']}, but its last attempt "
            "was aborted by Spark and rolled back, and no run has tried it since (the "
            "query failed or was stopped in it; its driver log says why): fix the cause "
            "and restart the query, which replays the batch"
        )
    if status.open_attempts:
        staged = (
            f"; {d['staged_txns']} prepared transaction(s) holding their rows' locks"
            if d["staged_txns"]
            else ""
        )
        print(
            f"  unfinished: snapshot(s) {', '.join(map(str, status.open_attempts))} allocated "
            f"and not recorded{staged}: a batch of a running query, or what a failed or "
            "killed run left, which the query's next start rolls back (or: pyspark-txn "
            f"abandon {shlex.quote(args.location)} --snapshot N)"
        )
    if status.open_exports:
        n = status.open_exports[0] if len(status.open_exports) == 1 else "N"
        print(
            f"  export: snapshot id(s) {', '.join(map(str, status.open_exports))} allocated "
            "by an export that has not registered yet: an export running now, or what a "
            "killed export left (once none runs: pyspark-txn abandon "
            f"{shlex.quote(args.location)} --snapshot {n} withdraws it; export again to "
            "the same --to with --replace-unfinished)"
        )
    if d["last_batch"] is None:
        print("  no batch recorded yet")
    else:
        lag = d["lag_seconds"]
        print(
            f"  last batch {d['last_batch']} (snapshot {d['last_snapshot_id']}, "
            f"{d['last_rows']} rows), recorded {d['last_recorded_at']}"
            + (f", {lag:.0f} s ago" if lag is not None else "")
        )
    if d["spark_planned_batch"] is not None:
        committed = d["spark_committed_batch"]
        print(
            f"  Spark's checkpoint: batch {d['spark_planned_batch']} planned, "
            + ("no batch committed" if committed is None else f"batch {committed} committed")
        )
    target = d["target"]
    if target is None:
        print("  target: not known yet (no snapshot record names it)")
    elif d["target_error"]:
        print(f"  target {target}: cannot be read: {d['target_error']}")
    elif d["target_kind"] == admin.POSTGRES:
        print(
            f"  target {target}: {_holds(d['target_batch'])} "
            f"(pyspark_txn_batches); {d['staged_txns']} prepared transaction(s) of "
            f"{d['staged_attempts']} attempt(s) pending"
        )
    elif d["target_version"] is None:
        print(f"  target {target}: no table")
    else:
        print(
            f"  target {target}: version {d['target_version']}, "
            f"{_holds(d['target_batch'])}; staging markers of "
            f"{d['staged_attempts']} recent attempt(s) (kept until ~32 batches later)"
        )
    for problem in status.problems:
        print(f"  problem: {problem}")
    if d["run_id"] is None:
        print("  no run holds the sink yet (a run takes it at its first commit)")
    else:
        query = f" (query {d['query_id']})" if d["query_id"] else ""
        print(f"  run {d['run_id']} holds epoch {d['epoch']}{query}")
    print(
        f"  record table {d['record_table']}: {d['record_table_events']} events in its "
        f"history, {d['record_table_files']} files, {d['record_table_bytes']} bytes"
    )
    for r in status.export_requests:
        print(
            f"  export {r.name!r} requested for the next commit, to {r.location} (see: "
            f"pyspark-txn snapshots show {shlex.quote(args.location)} {r.name})"
        )
    for s in status.stuck:
        print("  stuck: " + "\n    ".join(_describe(s)))
        print(f"    see: pyspark-txn stuck {shlex.quote(args.location)}")
    return 0 if status.healthy else 1


def _holds(batch: int | None) -> str:
    if batch is None:
        return "holds no batch of this sink"
    return f"holds this sink's batches up to {batch}"


_CANNOT_SUCCEED = {
    admin.POSTGRES: "a prepared transaction is gone, rolled back outside the sink",
    admin.DELTA: "files lost, target dropped or altered",
}


def cmd_stuck(args: argparse.Namespace) -> int:
    handle = _open(args)
    stuck = admin.stuck_snapshots(handle)
    if args.json:
        out = {
            "sink_id": handle.sink_id,
            "record_table": handle.record_table,
            "target_kind": handle.kind,
            "target": handle.target_label,
            "target_uri": handle.target_uri,
            "stuck": [s.to_json() for s in stuck],
        }
        print(json.dumps(out, indent=2))
        return 0
    if not stuck:
        print(f"sink {handle.sink_id}: no stuck snapshots")
        return 0
    print(f"sink {handle.sink_id}: {len(stuck)} snapshot record(s) whose phase 2 never completed")
    print(f"  target {handle.target_label}")
    why = _CANNOT_SUCCEED.get(handle.kind or admin.DELTA, _CANNOT_SUCCEED[admin.DELTA])
    for status in stuck:
        print()
        print("\n".join(_describe(status)))
        if status.refusal is None:
            print(f"  if phase 2 can no longer succeed ({why}), withdraw it and restart the query:")
            print(
                f"    pyspark-txn abandon {shlex.quote(args.location)} "
                f"--snapshot {status.snapshot_id} --sink {handle.sink_id}"
            )
            print("  otherwise restarting the query finishes it")
        else:
            print(f"  not abandonable: {status.refusal}")
    return 0


def cmd_abandon(args: argparse.Namespace) -> int:
    handle = _open(args)
    status = admin.snapshot_status(handle, args.snapshot)
    print("\n".join(_describe(status)))
    if status.state == "abandoned":
        if status.txn_states:  # prepared after the attempt was abandoned: dead, as a sweep knows
            admin.abandon_snapshot(handle, args.snapshot, args.reason)
            print(
                f"it is already abandoned; rolled back the {len(status.txn_states)} prepared "
                "transaction(s) its tasks left, as recovery would"
            )
            return 0
        print("nothing to do: it is already abandoned")
        return 0
    if status.refusal is not None:
        print(
            f"pyspark-txn: error: snapshot {args.snapshot} cannot be abandoned: {status.refusal}",
            file=sys.stderr,
        )
        return 2
    if not args.yes:
        if not sys.stdin.isatty():
            print(
                "pyspark-txn: error: abandon asks for confirmation, but stdin is not a "
                "terminal; pass --yes to abandon without asking",
                file=sys.stderr,
            )
            return 2
        gone = (
            "prepared transactions are rolled back"
            if handle.kind == admin.POSTGRES
            else "staged files are deleted"
        )
        answer = input(
            f"Abandon snapshot {args.snapshot}? Its {gone} and it can never be committed. [y/N] "
        )
        if answer.strip().lower() not in ("y", "yes"):
            print("not abandoned")
            return 1
    admin.abandon_snapshot(handle, args.snapshot, args.reason)
    print(f"snapshot {args.snapshot} of sink {handle.sink_id} is abandoned.")
    if handle.kind == admin.POSTGRES:
        print("Its prepared transactions are rolled back, as recovery would.")
    if status.target_gone is not None:
        print(f"But {status.target_gone}. {_gone_restart(status)}.")
    elif status.record is not None:
        print(
            f"Restart the query: Spark replays batch {status.record.batch_id} and it is "
            "decided anew under a new snapshot id."
        )
    return 0


def _progress_bar(desc: str = "verify"):
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


def cmd_verify(args: argparse.Namespace) -> int:
    handle = _open(args)
    progress, close = _progress_bar()
    try:
        report = admin.verify(handle, progress)
    finally:
        close()
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0 if report.ok else 1
    files = sum(s.files for s in report.snapshots)
    print(
        f"sink {report.sink_id}: {len(report.snapshots)} live snapshot records, {files} "
        f"{handle.terms.txns} in {report.target_uri}"
    )
    for sid, p in report.problems:
        print(f"  {p.severity}: snapshot {sid}: {p.handle}: {p.message}")
    errors, warnings = len(report.errors), len(report.warnings)
    print(
        "OK" + (f" ({warnings} warnings)" if warnings else "")
        if report.ok
        else f"{errors} problems found" + (f", {warnings} warnings" if warnings else "")
    )
    return 0 if report.ok else 1


def _named_lines(n) -> list[str]:
    d = n.details
    return [
        f"{n.name}: snapshot {n.snapshot_id}, batch {n.batch_id} (sink snapshot "
        f"{n.of_snapshot_id}, table version {n.target_version}), created "
        f"{n.created_at.isoformat() if n.created_at else '?'}",
        f"  {d.get('rows')} rows in {len(d.get('files', []))} files ({d.get('bytes')} bytes) "
        f"at {n.location}",
    ]


def _state_spark(args: argparse.Namespace):
    """A local SparkSession when the export must read a stateful query's state tables."""
    from .state_export import has_state

    if args.state == "skip":
        return None
    handle = admin.open_sink(args.location, args.sink)
    if handle.checkpoint is None or not has_state(handle.checkpoint, handle.storage):
        return None
    from .session import local_session

    return local_session(app_name="pyspark-txn snapshots export")


def cmd_snapshots_export(args: argparse.Namespace) -> int:
    from . import snapshots

    if args.at_next_commit:
        if args.snapshot is not None or args.batch is not None:
            raise ConfigError("--snapshot/--batch and --at-next-commit exclude each other")
        if args.replace_unfinished:
            raise ConfigError(
                "--replace-unfinished and --at-next-commit exclude each other: the sink "
                "never removes anything at a requested location"
            )
        request = snapshots.request_export(
            args.location, args.name, args.to, sink=args.sink, state=args.state
        )
        if args.wait is None:
            if args.json:
                print(json.dumps({"requested": request.to_json()}, indent=2))
            else:
                print(
                    f"requested {request.name}: the sink exports the batch it commits next to "
                    f"{request.location}; check with: pyspark-txn snapshots show "
                    f"{args.location} {request.name}"
                )
            return 0
        named = snapshots.wait_for_export(
            args.location, args.name, sink=args.sink, timeout=args.wait
        )
    else:
        if args.wait is not None:
            raise ConfigError("--wait needs --at-next-commit")
        # the cheap checks first: a local Spark session takes half a minute to start
        snapshots.check_export(
            args.location,
            args.name,
            args.to,
            args.snapshot,
            sink=args.sink,
            replace_unfinished=args.replace_unfinished,
            batch=args.batch,
        )
        spark = _state_spark(args)
        progress, close = _progress_bar("export")
        try:
            named = snapshots.export(
                args.location,
                args.name,
                args.to,
                args.snapshot,
                sink=args.sink,
                progress=progress,
                state=args.state,
                spark=spark,
                replace_unfinished=args.replace_unfinished,
                batch=args.batch,
            )
        except TxnError:
            raise
        except Exception as e:  # the export withdrew its id and copy: one line, exit 2
            if storage.describe_store_error(e) is not None:
                raise
            raise TxnError(
                f"export {args.name!r} to {args.to} failed ({type(e).__name__}: {e}); its "
                "partial copy was removed and nothing was registered"
            ) from e
        finally:
            close()
    if args.json:
        print(json.dumps(named.to_json(), indent=2))
    else:
        print("exported " + "\n".join(_named_lines(named)))
        print(f"  data: {named.location}/data   manifest: {named.location}/manifest")
    return 0


def cmd_snapshots_prepare_query(args: argparse.Namespace) -> int:
    from . import snapshots

    progress, close = _progress_bar("copy")
    try:
        prepared = snapshots.prepare_query(
            args.location,
            args.name,
            args.checkpoint,
            args.path,
            sink=args.sink,
            progress=progress,
        )
    finally:
        close()
    if args.json:
        print(json.dumps(dataclasses.asdict(prepared), indent=2, default=str))
        return 0
    print(
        f"prepared: checkpoint {prepared.checkpoint} resumes after batch {prepared.batch_id}; "
        f"table {prepared.path} holds {prepared.rows} rows.\n"
        "Start the same query (same sources, same order) with "
        f".option('checkpointLocation', {prepared.checkpoint!r}) and the txn-delta sink's "
        f".option('path', {prepared.path!r})."
    )
    return 0


def cmd_snapshots_offsets(args: argparse.Namespace) -> int:
    from . import snapshots

    if args.kafka:
        print(snapshots.kafka_starting_offsets(args.location, args.name, args.source, args.sink))
        return 0
    offsets = snapshots.source_offsets(args.location, args.name, args.sink)
    if args.json:
        print(json.dumps(offsets, indent=2))
        return 0
    for i, offset in enumerate(offsets):
        print(f"{i}\t{offset if offset is not None else '-'}")
    return 0


def _request_json(r) -> dict:
    return {**r.to_json(), "state": "requested"}


def cmd_snapshots_list(args: argparse.Namespace) -> int:
    from . import snapshots

    named = snapshots.list_snapshots(args.location, args.sink)
    requests = snapshots.list_requests(args.location, args.sink)
    if args.json:
        print(
            json.dumps(
                [{**n.to_json(), "state": "exported"} for n in named]
                + [_request_json(r) for r in requests],
                indent=2,
            )
        )
        return 0
    if not named and not requests:
        print("no named snapshots")
    for n in named:
        print(
            f"{n.name}\texported\tsnapshot {n.snapshot_id}\tbatch {n.batch_id}\t"
            f"{n.details.get('rows')} rows\t{n.location}"
        )
    for r in requests:
        print(
            f"{r.name}\trequested\tfor the next commit\t\t"
            f"since {r.requested_at.isoformat() if r.requested_at else '?'}\t{r.location}"
        )
    return 0


def cmd_snapshots_show(args: argparse.Namespace) -> int:
    from . import snapshots

    pending = {
        r.name: r
        for r in snapshots.list_requests(args.location, args.sink, command="snapshots show")
    }
    if args.name in pending:
        r = pending[args.name]
        if args.json:
            print(json.dumps(_request_json(r), indent=2))
            return 0
        print(
            f"{r.name}: requested (not exported yet): the sink exports the batch it commits "
            f"next to {r.location}; requested "
            f"{r.requested_at.isoformat() if r.requested_at else '?'}\n"
            f"  cancel with: pyspark-txn snapshots cancel {shlex.quote(args.location)} {r.name}"
        )
        return 0
    n = snapshots.show(args.location, args.name, args.sink)
    if args.json:
        print(json.dumps({**n.to_json(), "state": "exported"}, indent=2))
        return 0
    print("\n".join(_named_lines(n)))
    print(f"  Spark's offsets of batch {n.batch_id}: {n.details.get('source_offsets')}")
    print(f"  data checksum {n.details.get('data_checksum')}")
    return 0


def cmd_snapshots_cancel(args: argparse.Namespace) -> int:
    from . import snapshots

    r = snapshots.cancel_request(args.location, args.name, sink=args.sink)
    if args.json:
        print(json.dumps({"cancelled": r.to_json()}, indent=2))
    else:
        print(f"cancelled the requested export {r.name} (to {r.location})")
    return 0


def cmd_snapshots_verify(args: argparse.Namespace) -> int:
    from . import snapshots

    progress, close = _progress_bar("verify")
    try:
        check = snapshots.verify(args.location, args.name, args.sink, progress)
    finally:
        close()
    if args.json:
        print(json.dumps(check.to_json(), indent=2))
        return 0 if check.ok else 1
    if check.readable:
        print(f"{check.name}: {check.files} files, {check.rows} rows at {check.location}")
    else:
        print(f"{check.name}: unreadable export at {check.location}")
    for p in check.problems:
        print(f"  error: {p}")
    print("OK" if check.ok else f"{len(check.problems)} problems found")
    return 0 if check.ok else 1


def cmd_snapshots_delete(args: argparse.Namespace) -> int:
    from . import snapshots

    n = snapshots.show(args.location, args.name, args.sink)
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(
                "delete asks for confirmation, but stdin is not a terminal; pass --yes to "
                "delete without asking"
            )
        answer = input(f"Delete snapshot {n.name!r} and everything under {n.location}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("not deleted")
            return 1
    snapshots.delete(args.location, args.name, args.sink)
    if args.json:
        print(json.dumps({"deleted": n.to_json()}, indent=2))
    else:
        print(f"deleted {n.name} ({n.location})")
    return 0


DEMO_MARKER = ".pyspark-txn-demo"
DEMO_OUTPUTS = {"orders", "checkpoint"}  # what demos before the marker left behind


def cmd_demo(args: argparse.Namespace) -> int:
    """txn-sequence -> txn-delta in a few micro-batches, read back, then a replay."""
    from deltalake import DeltaTable

    from . import local_session

    base = os.path.abspath(args.dir)
    marker = os.path.join(base, DEMO_MARKER)
    if os.path.exists(base) and not os.path.isdir(base):
        raise ConfigError(f"--dir {args.dir}: is a file; choose a new or empty directory")
    entries = set(os.listdir(base)) if os.path.isdir(base) else set()
    if entries and DEMO_MARKER not in entries and not entries <= DEMO_OUTPUTS:
        raise ConfigError(
            f"--dir {args.dir}: the directory exists and was not made by the demo; "
            "choose a new or empty directory (the demo starts afresh by deleting its own)"
        )
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    with open(marker, "w") as f:
        f.write("made by `pyspark-txn demo`; the next demo run deletes this directory\n")
    target, checkpoint = os.path.join(base, "orders"), os.path.join(base, "checkpoint")
    print(f"pyspark-txn demo in {base}: starting a local Spark session ...", flush=True)
    spark = local_session("pyspark-txn-demo")

    def run() -> None:
        (
            spark.readStream.format("txn-sequence")
            .option("rowsPerBatch", args.rows // 4)
            .option("totalRows", args.rows)
            .load()
            .writeStream.format("txn-delta")
            .option("path", target)
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start()
            .awaitTermination()
        )

    run()
    dt = DeltaTable(target)
    table = dt.to_pyarrow_table()
    ids = table.column("id").to_pylist()
    print(f"\n1. Streamed {args.rows} rows into the Delta table {target}")
    print(
        f"   read back with delta-rs: {table.num_rows} rows, {len(set(ids))} distinct ids, "
        f"table version {dt.version()}"
    )
    print("\n2. The record table (snapshot records written before each commit):")
    _print_records(admin.find_record_table(checkpoint)[0])

    last = max(int(n) for n in os.listdir(os.path.join(checkpoint, "commits")) if n.isdigit())
    for name in (str(last), f".{last}.crc"):  # Hadoop keeps a checksum file beside it
        path = os.path.join(checkpoint, "commits", name)
        if os.path.exists(path):
            os.remove(path)
    print(
        f"\n3. Replay: deleted Spark's commit log of batch {last}, as if the driver died "
        "right after our commit; restarting the query ..."
    )
    handle = admin.open_sink(checkpoint)
    store = handle.record_store()
    seen = len(store.events(handle.sink_id))
    run()
    new = [
        "epoch(a new run)"
        if e.kind.value == "epoch"
        else f"{e.kind.value}(snapshot={e.snapshot_id})"
        for e in store.events(handle.sink_id)[seen:]
    ]
    dt = DeltaTable(target)
    again = dt.to_pyarrow_table().num_rows
    print(f"   Spark ran batch {last} again. New record events: {', '.join(new)}:")
    print("   the restarted query is a new run and took the sink's epoch; a new snapshot id")
    print("   was reserved for the attempt, but there is no new snapshot")
    print(f"   record: batch {last} was already decided, so phase 2 was a no-op and the")
    print("   attempt's staged files were discarded.")
    print(f"   The table still holds {again} rows (version {dt.version()}): exactly once.")
    spark.stop()
    return 0 if again == args.rows else 1


LOCATION_HELP = "checkpoint location, or record table URI"


def _storage_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-options",
        metavar="JSON|@FILE",
        help="object-store options for every store the command reads or writes, as the "
        'sink\'s storageOptions: a JSON object (e.g. \'{"AWS_REGION": "eu-west-1"}\') or '
        "@file holding one (default: credentials from the environment); "
        "see docs/object-stores.md",
    )


def _read_storage_options(raw: str | None) -> storage.StorageOptions:
    """--storage-options, parsed before anything is touched (@file: the file's text)."""
    if raw is None:
        return storage.StorageOptions()
    if raw.startswith("@"):
        try:
            with open(raw[1:], encoding="utf-8") as f:
                raw = f.read()
        except OSError as e:
            raise ConfigError(f"--storage-options {raw}: cannot read the file: {e}") from None
    return storage.StorageOptions.parse(raw, "command line", "--storage-options")


def _sink_arguments(p: argparse.ArgumentParser, *, name: bool = False, as_json: bool = True):
    """The arguments every sink command takes: where, which sink (and name), --json,
    --storage-options."""
    _storage_argument(p)
    p.add_argument("location", help=LOCATION_HELP)
    if name:
        p.add_argument("name")
    p.add_argument("--sink", help=SINK_HELP)
    if as_json:
        p.add_argument("--json", action="store_true", help="print JSON")


SINK_HELP = "sink id (default: the checkpoint's kept sink id, or the record table's only sink)"


def _target_arguments(p: argparse.ArgumentParser) -> None:
    """How a command reaches a txn-postgres sink's database (docs/postgres.md)."""
    p.add_argument(
        "--url",
        help="txn-postgres: the database, as a libpq URI or key=value string (default: the "
        "one the sink's records keep, without its password). The password comes from "
        "--password-file, else libpq: PGPASSWORD or ~/.pgpass (PGPASSFILE); it is never "
        "printed",
    )
    p.add_argument("--password-file", help="txn-postgres: a file holding the password")


class _Parser(argparse.ArgumentParser):
    """argparse, whose usage errors come out as JSON when the command line has --json."""

    json_errors = False

    def error(self, message: str):
        if _Parser.json_errors:
            self.print_usage(sys.stderr)
            print(
                json.dumps({"error": message, "type": "UsageError", "usage": self.format_usage()})
            )
            sys.exit(2)
        super().error(message)


def main(argv: list[str] | None = None) -> int:
    _Parser.json_errors = "--json" in (sys.argv[1:] if argv is None else [str(a) for a in argv])
    parser = _Parser(prog="pyspark-txn", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log protocol steps")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run the embedded exactly-once demo (local Delta tables)")
    p.add_argument("--dir", default="./demo", help="where the demo writes (default ./demo)")
    p.add_argument("--rows", type=int, default=10_000, help="rows to stream (default 10000)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("records", help="show a sink's execution record and record events")
    p.add_argument("location", help=LOCATION_HELP)
    p.add_argument("--sink", help="only this sink id")
    _storage_argument(p)
    p.set_defaults(func=cmd_records)
    p = sub.add_parser(
        "status",
        help="summarise a sink: last batch, lag, target, record-table size, anything stuck",
        description="Summarise one sink (txn-delta or txn-postgres) from its record table, "
        "target and Spark "
        "checkpoint, without Spark: the last recorded batch and how long ago, what the "
        "target holds, the run holding the sink, the record table's size, and any snapshot "
        "whose phase 2 never completed. Safe while the query runs.",
        epilog="exit status: 0 healthy, 1 needs attention (stuck snapshot or unreadable "
        "target), 2 error",
    )
    _sink_arguments(p)
    _target_arguments(p)
    p.set_defaults(func=cmd_status)
    snaps = sub.add_parser(
        "snapshots",
        help="named snapshots: export, list, show, verify, delete, cancel, prepare-query, offsets",
        description="Named snapshots of a txn-delta sink: a committed snapshot exported as "
        "standalone Delta tables (data/, manifest/) and registered under a name in the "
        "sink's record table. See docs/snapshots.md.",
    )
    ssub = snaps.add_subparsers(dest="snapshots_command", required=True)
    p = ssub.add_parser(
        "export",
        help="export a committed snapshot under a name",
        description="Copy the sink's target as of a committed snapshot (default: the "
        "latest) to TO/data, write TO/manifest, then register NAME. Export-only: the "
        "running query is not touched.",
        epilog="exit status: 0 exported, 2 error",
    )
    p.add_argument("location", help=LOCATION_HELP)
    _storage_argument(p)
    p.add_argument("name", help="letters, digits, '-', '_', '.'; unique per sink")
    p.add_argument("--to", required=True, help="a new or empty directory (URI)")
    p.add_argument("--snapshot", type=int, help="the sink's snapshot id (default: latest)")
    p.add_argument(
        "--batch", type=int, help="Spark's batch id, instead of --snapshot (default: latest)"
    )
    p.add_argument(
        "--at-next-commit",
        action="store_true",
        help="ask the running query to export the batch it commits next (inside its commit)",
    )
    p.add_argument(
        "--wait",
        type=float,
        metavar="SECONDS",
        help="with --at-next-commit: wait up to SECONDS for the export (default: do not wait)",
    )
    p.add_argument(
        "--state",
        choices=("auto", "include", "skip"),
        default="auto",
        help="state tables of a stateful query: auto (if it has state; starts a local Spark), "
        "include (required), skip",
    )
    p.add_argument(
        "--replace-unfinished",
        action="store_true",
        help="remove the partial copy of an unfinished export at --to even if its writer may "
        "still run (only when you know it is dead)",
    )
    p.add_argument("--sink", help=SINK_HELP)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_snapshots_export)
    p = ssub.add_parser(
        "prepare-query",
        help="prepare a checkpoint and table that start a new query at a named snapshot",
        description="Copy the snapshot's data into a new table at --path and write a Spark "
        "checkpoint at --checkpoint whose last committed batch is the snapshot's, with its "
        "offsets. The same query started with both resumes exactly there.",
        epilog="exit status: 0 prepared, 2 error",
    )
    _sink_arguments(p, name=True)
    p.add_argument("--checkpoint", required=True, help="the new query's checkpoint (new/empty)")
    p.add_argument("--path", required=True, help="the new query's target table (new/empty)")
    p.set_defaults(func=cmd_snapshots_prepare_query)
    p = ssub.add_parser(
        "offsets",
        help="print the snapshot's source offsets (e.g. a Kafka startingOffsets JSON)",
        epilog="exit status: 0, 2 error",
    )
    _sink_arguments(p, name=True)
    p.add_argument(
        "--kafka", action="store_true", help="print source --source as Kafka startingOffsets"
    )
    p.add_argument("--source", type=int, default=0, help="source index for --kafka (default 0)")
    p.set_defaults(func=cmd_snapshots_offsets)
    p = ssub.add_parser("list", help="list named snapshots", epilog="exit status: 0, 2 error")
    _sink_arguments(p)
    p.set_defaults(func=cmd_snapshots_list)
    p = ssub.add_parser("show", help="show one named snapshot", epilog="exit status: 0, 2 error")
    _sink_arguments(p, name=True)
    p.set_defaults(func=cmd_snapshots_show)
    p = ssub.add_parser(
        "verify",
        help="re-read an export; compare files, sizes, CRC32s and rows with the registry",
        epilog="exit status: 0 OK, 1 mismatches found, 2 error",
    )
    _sink_arguments(p, name=True)
    p.set_defaults(func=cmd_snapshots_verify)
    p = ssub.add_parser(
        "delete",
        help="unregister a named snapshot and remove its export",
        epilog="exit status: 0 deleted, 1 declined at the prompt, 2 error",
    )
    _sink_arguments(p, name=True)
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=cmd_snapshots_delete)
    p = ssub.add_parser(
        "cancel",
        help="cancel an export requested with --at-next-commit that has not run yet",
        epilog="exit status: 0 cancelled, 2 error (also: the export already ran)",
    )
    _sink_arguments(p, name=True)
    p.set_defaults(func=cmd_snapshots_cancel)
    p = sub.add_parser(
        "stuck",
        help="list snapshot records whose phase 2 never completed",
        description="List the sink's safe snapshot records whose phase 2 was never "
        "confirmed, with what the target holds. Restarting the query finishes them; one "
        "whose phase 2 can no longer succeed is withdrawn with `pyspark-txn abandon`. A "
        "running query shows its current batch here for a moment.",
    )
    _sink_arguments(p)
    _target_arguments(p)
    p.set_defaults(func=cmd_stuck)
    p = sub.add_parser(
        "abandon",
        help="withdraw a stuck snapshot record (or an open allocation)",
        description="Withdraw a snapshot record whose phase 2 can never succeed, or an open "
        "allocation: append an `abandoned` event and delete its staged files (txn-postgres: "
        "roll back its prepared transactions, as recovery would). Refused for a committed "
        "snapshot, a record that is not the last one, a batch the target already holds, and "
        "(txn-postgres) a record whose prepared transactions can all still commit or of "
        "which some already did. Stop the query first. Afterwards restart it: Spark "
        "replays the batch and it is decided anew under a new snapshot id.",
        epilog="exit status: 0 abandoned (or already abandoned), 1 declined at the prompt, "
        "2 refused or error (also: no terminal to confirm on and no --yes)",
    )
    p.add_argument("location", help=LOCATION_HELP)
    _storage_argument(p)
    p.add_argument("--snapshot", type=int, required=True, help="the snapshot id to abandon")
    p.add_argument("--sink", help=SINK_HELP)
    p.add_argument(
        "--reason", default="abandoned by an operator", help="kept in the abandoned event"
    )
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    _target_arguments(p)
    p.set_defaults(func=cmd_abandon)
    p = sub.add_parser(
        "verify",
        help="re-read every file a live snapshot record names; check sizes and CRC32s",
        description="Re-read every file named by a live (not abandoned) snapshot record of "
        "the sink and check it exists with the recorded size and CRC32. A committed "
        "record's file that is no longer in the target's current version (a later delete "
        "or vacuum) is a warning, not an error. txn-postgres: every prepared transaction "
        "a live record names must be committed with the recorded row count (or, while its "
        "phase 2 is pending, still prepared), and each committed batch's row in "
        "pyspark_txn_batches must be the record's own.",
        epilog="exit status: 0 all files OK (warnings allowed), 1 problems found, 2 error",
    )
    _sink_arguments(p)
    _target_arguments(p)
    p.set_defaults(func=cmd_verify)
    _backups_cli.register(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _quiet_store_clients(args.verbose)
    real = sys.stdout
    sys.stdout = _Output(real)
    try:
        code = _dispatch(args)
        sys.stdout.flush()  # a small output is only written here
        return code
    except _OutputError as e:  # stdout is full or gone: say so where it can be read
        cause = e.__cause__
        print(f"pyspark-txn: error: cannot write output ({cause!r})", file=sys.stderr)
        return 2
    finally:
        sys.stdout = real


class _OutputError(Exception):
    """stdout cannot be written (a full disk, ``> /dev/full``): not the store's failure."""


class _Output:
    """stdout, whose write errors (other than a closed pipe) raise :class:`_OutputError`,
    so they are never taken for a store's error nor answered by more output."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _OutputError() from e

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _OutputError() from e

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _dispatch(args: argparse.Namespace) -> int:
    """Run the command; errors become one line on stderr (and JSON under --json), exit 2."""
    try:
        with storage.using(_read_storage_options(getattr(args, "storage_options", None))):
            return args.func(args)
    except _OutputError:
        raise
    except TxnError as e:
        print(f"pyspark-txn: error: {e}", file=sys.stderr)
        if getattr(args, "json", False):  # scripts still get a document to parse
            print(json.dumps({"error": str(e), "type": type(e).__name__}))
        return 2
    except BrokenPipeError:  # `pyspark-txn records ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # a store or a location that cannot be read or written: one line
        problem = storage.describe_store_error(e)
        kind = "StorageError"
        if problem is None and isinstance(e, OSError):
            problem, kind = f"{type(e).__name__}: {e}", type(e).__name__
        if problem is None:
            raise
        print(f"pyspark-txn: error: {problem}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"error": problem, "type": kind}))
        return 2


def run() -> NoReturn:
    """The ``pyspark-txn`` command: :func:`main`, then exit with its status at once.

    An exit code is the command's contract, but a normal interpreter exit runs the
    native libraries' teardown (delta-rs' runtime threads, pyarrow's pools), which
    aborted in about 1 run of 6 (``terminate called without an active exception``,
    status 134) after the command had printed its result. So: flush what was
    written, then ``os._exit`` with the status, skipping that teardown.
    """
    try:
        code = main()
    except SystemExit as e:  # argparse's usage errors and --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        print("pyspark-txn: interrupted", file=sys.stderr)
        code = 130
    except BaseException:  # a bug: the traceback, as an uncaught error would print it
        import traceback

        traceback.print_exc()
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be written
            pass
    os._exit(code)


def _quiet_store_clients(verbose: bool) -> None:
    """No warning floods from the object-store clients (instance-metadata retries when
    credentials are missing): their failure comes back as one error line instead."""
    if verbose:
        return
    for name in ("botocore", "aiobotocore", "s3fs", "adlfs", "gcsfs", "urllib3", "azure"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("RUST_LOG", "error")


if __name__ == "__main__":
    run()
