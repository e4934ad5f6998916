"""Light mode (seed 002, Jet's light jobs): no snapshot records, no record table.

A light sink stages files exactly as the default mode does and commits them
to Delta with the app transaction ``txn(appId=sinkId, version=batchId)``: a
batch the table already holds is a replay and is dropped. That makes it
exactly-once for sources that replay the same data for the same batch, and
nothing more: there is no fencing of a second query on the same checkpoint,
no record of what a batch held, no named snapshots, and files of a crashed
attempt stay in the table folder (never in the table) until ``VACUUM``.
See docs/modes.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..faults import NO_FAULTS, FaultPlan
from ..state import TxnHandle
from .delta_target import DeltaTarget

log = logging.getLogger(__name__)

#: The snapshot id in the names of a light sink's staged files (it allocates
#: none); the random token per attempt keeps them apart.
LIGHT_SNAPSHOT_ID = 0


class LightCommitter:
    def __init__(self, target: DeltaTarget, sink_id: str, faults: FaultPlan = NO_FAULTS) -> None:
        self.target = target
        self.sink_id = sink_id
        self.faults = faults

    def commit(
        self,
        batch_id: int,
        token: str,
        txns: Sequence[TxnHandle],
        *,
        query_id: str | None,
        target_meta: Mapping[str, Any],
    ) -> int | None:
        """Commit ``batch_id`` unless the table already holds it; return the new version."""
        started = time.perf_counter()
        version, held = self.target.commit_batch(batch_id, txns, query_id, target_meta)
        self.faults.hit("after_phase2", batch_id)
        if held:
            log.info(
                "sink %s (light): batch %d is already in the table; this attempt's files go",
                self.sink_id,
                batch_id,
            )
            self.target.discard(LIGHT_SNAPSHOT_ID, token)
        self.target.forget(LIGHT_SNAPSHOT_ID, token)
        self.faults.hit("after_commit", batch_id)
        if held:
            return None
        log.info(
            "sink %s (light): batch %d committed: %d rows, %d files, %d bytes, %s; %.0f ms",
            self.sink_id,
            batch_id,
            sum(t.rows for t in txns),
            len(txns),
            sum(t.bytes for t in txns),
            "no Delta commit (empty batch)" if version is None else f"table version {version}",
            (time.perf_counter() - started) * 1000,
        )
        return version

    def abort(self, token: str, batch_id: int) -> None:
        """Roll back one attempt's files, unless the table holds ``batch_id``: a commit
        that landed and then failed (or a failure after it) must keep its files, and
        without a record there is no telling whose files the table holds. Files kept
        that the table does not hold are left to VACUUM, as a crashed attempt's are."""
        done = self.target.committed_batch(self.sink_id)
        if done is not None and done >= batch_id:
            log.warning(
                "sink %s (light): batch %d failed after the table got batch %d; this "
                "attempt's files are kept (VACUUM removes any the table does not hold)",
                self.sink_id,
                batch_id,
                done,
            )
        else:
            self.target.discard(LIGHT_SNAPSHOT_ID, token)
        self.target.forget(LIGHT_SNAPSHOT_ID, token)
