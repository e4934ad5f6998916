"""A Delta target for ``outputMode("complete")``: each batch is the query's whole result,
and phase 2 replaces the table's rows with it in one commit (an overwrite carrying the
sink's app transaction). A reader sees one whole result or the next, never an empty,
partial or doubled table; a replayed batch is a no-op as for appends.

An empty batch is an empty result, so it is committed too (the table becomes empty),
where an append sink makes no commit for one."""

from __future__ import annotations

from .delta_target import DeltaTarget


class DeltaOverwriteTarget(DeltaTarget):
    commits_empty_batches = True
    write_mode = "overwrite"
