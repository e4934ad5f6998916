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

from ..state import TxnHandle
from .delta_target import DeltaTarget

log = logging.getLogger(__name__)

#: The snapshot id in the names of a light sink's staged files (it allocates
#: none); the random token per attempt keeps them apart.
LIGHT_SNAPSHOT_ID = 0


class LightCommitter:
    def __init__(self, target: DeltaTarget, sink_id: str) -> None:
        self.target = target
        self.sink_id = sink_id

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
        if held:
            log.info(
                "sink %s (light): batch %d is already in the table; this attempt's files go",
                self.sink_id,
                batch_id,
            )
            self.target.discard(LIGHT_SNAPSHOT_ID, token)
        self.target.forget(LIGHT_SNAPSHOT_ID, token)
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

    def abort(self, token: str) -> None:
        self.target.discard(LIGHT_SNAPSHOT_ID, token)
        self.target.forget(LIGHT_SNAPSHOT_ID, token)
