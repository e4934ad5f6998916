"""Consistent backups of a whole pipeline: one named snapshot per query, as a set.

Members are the checkpoints of queries whose sinks write Delta tables
(``txn-delta``). Queries are linked when one's ``txn-delta`` source reads the
table another's sink writes (``reads=``). A backup is consistent when no
downstream part holds rows derived from upstream data its upstream part lacks
(seed 001): the parts form an exact cut.

How (docs/backups.md has the argument): parts are *planned* downstream first.
A query no other member reads is pinned at its latest committed batch; the
upstream version ``V`` a downstream part consumed is in that batch's source
offset (``{"version": V + 1, "index": 0, ...}``: everything through ``V``); the
upstream part is then pinned at the committed batch whose commit made exactly
version ``V``, and so on up the chain. Restore copies each part into a new
table (version 0 = the pinned version) and rewrites each downstream offset to
the restored upstream table's next version, so the chain resumes exactly there.

The catalog is a small Delta table ``<to>/_catalog``: one row per event
(started, member started/completed/failed, failed, completed, delete started, deleted).
A completed part's whole registry entry is in its ``member_completed`` event, so a
backup is read, verified and restored from ``to`` alone (:mod:`.parts`). A backup id is taken with a
conditional commit (no delta-rs retries, an app transaction versioned by the
id), so two takers can never both take an id, and ids only grow: a smaller or
used id is refused, also after a failed or deleted backup.

The parts: :mod:`.catalog`, :mod:`.plan` (the cut), :mod:`.parts` (what is known of each
part, and from where), :mod:`.take`, :mod:`.status` (status, list, verify, delete) and
:mod:`.restore`; this module names them all.
"""

from __future__ import annotations

from ...errors import BackupError  # noqa: F401 (callers catch it from here)
from .catalog import (  # noqa: F401 (the names of operations.backups)
    _APP,
    _LIVE,
    CATALOG,
    COMPLETED,
    DELETED,
    DELETING,
    DOES_NOT_EXIST,
    FAILED,
    FAULT_ENV,
    IN_PROGRESS,
    INCOMPLETE,
    MAX_ID,
    RESTORE_MARKER,
    UNKNOWN,
    _append,
    _backup_dir,
    _catalog_id,
    _catalog_uri,
    _event,
    _events,
    _fault,
    _find_catalog,
    _is_ours,
    _now,
    _open_catalog,
    _owner,
    _owner_is_dead,
    _owner_of,
    _part_location,
    _process_start,
    _rows,
    _schema,
    _started,
    check_id,
    part_name,
)
from .parts import (  # noqa: F401 (the names of operations.backups)
    MEMBER_COMPLETED,
    catalog_parts,
    live_part,
    part_from_manifest,
)
from .plan import (  # noqa: F401 (the names of operations.backups)
    Member,
    _align_readers,
    _boundary_version,
    _check_sources,
    _committed,
    _downstream_first,
    _graph,
    _is_delta_offset,
    _members,
    _offset_dict,
    _plan,
    consumed_version,
)
from .restore import (  # noqa: F401 (the names of operations.backups)
    MEMBER_MARKER,
    Restored,
    _next_version,
    _running_queries,
    restore,
)
from .status import (  # noqa: F401 (the names of operations.backups)
    BackupCheck,
    BackupStatus,
    MemberStatus,
    _status_from,
    aggregate,
    delete,
    list_backups,
    show,
    status,
    verify,
)
from .take import (  # noqa: F401 (the names of operations.backups)
    _allocate,
    _take,
    take,
)

__all__ = [
    "BackupStatus",
    "MemberStatus",
    "Restored",
    "delete",
    "list_backups",
    "restore",
    "show",
    "status",
    "take",
    "verify",
]
