"""A Delta target for ``outputMode("complete")``: each batch is the query's whole result,
and phase 2 replaces the table's rows with it in one commit (an overwrite carrying the
sink's app transaction). A reader sees one whole result or the next, never an empty,
partial or doubled table; a replayed batch is a no-op as for appends.

An empty batch is an empty result, so it is committed too (the table becomes empty),
where an append sink makes no commit for one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..state import TxnHandle
from .delta_target import _NO_HOOKS, DeltaTarget, add_actions


class DeltaOverwriteTarget(DeltaTarget):
    commits_empty_batches = True

    def _apply(self, dt, txns: Sequence[TxnHandle], target_meta: Mapping[str, Any], props) -> None:
        dt.create_write_transaction(
            add_actions(txns),
            mode="overwrite",
            schema=dt.schema(),
            partition_by=self.partition_by or None,
            commit_properties=props,
            post_commithook_properties=_NO_HOOKS(),
        )
