"""Deterministic fault injection at named protocol steps, for crash tests only.

A plan is a comma-separated list of
``point:action[@batch=N][@snapshot=S][@partition=P]`` rules (executors know
the snapshot id, not the batch id), given through the test-only option ``faultInjection``. ``exit`` kills
the current Python process with ``os._exit`` (a crash: no cleanup runs);
``raise`` raises :class:`InjectedFault`; ``disconnect`` (only at ``mid_phase2``)
makes the PostgreSQL target lose its connection there, so the next
``COMMIT PREPARED`` meets a dead session. Never set it in production.

With the environment variable ``PYSPARK_TXN_FAULT_LOG`` set to a file path, every
rule that fires first appends a line to that file (fsynced before an ``exit``), so
a test can prove that its fault fired, not merely that the query failed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from .errors import ConfigError, TxnError

log = logging.getLogger(__name__)

POINTS = (
    "allocate",  # driver, before the snapshot id is reserved
    "phase1",  # executor, after staging a partition, before returning its message
    "mid_phase1",  # fast path (driver): the first of Spark's files renamed into the table
    "before_record",  # driver commit, staged files verified, record not written
    "after_record",  # record safe, phase 2 not started
    "mid_phase2",  # a phase 2 in two commits: PostgreSQL (after the first txn's), an
    # upsert with tombstones (they are written, the MERGE is not)
    "after_phase2",  # target committed, 'committed' event not written
    "after_commit",  # everything done, Spark's commit log not yet written
    # acknowledging sources (driver-side reader); batch=N matches the claim number
    "before_claim",  # broker deliveries taken, claim not written
    "after_claim",  # claim safe in the claim log, offset not returned to Spark
    "before_ack",  # committed claims through N about to be acked, none acked yet
    "mid_ack",  # half of their messages acked at the broker
    "after_ack",  # all acked at the broker, 'acked' not recorded in the claim log
)
ACTIONS = ("raise", "exit", "disconnect")
DISCONNECT_POINTS = ("mid_phase2",)  # where a target acts on ``disconnect``
EXIT_CODE = 86
FAULT_LOG_ENV = "PYSPARK_TXN_FAULT_LOG"


class InjectedFault(TxnError):
    """Raised by a ``raise`` rule."""


@dataclass(frozen=True)
class FaultRule:
    point: str
    action: str
    batch: int | None = None
    snapshot: int | None = None
    partition: int | None = None

    def matches(
        self, point: str, batch: int | None, snapshot: int | None, partition: int | None
    ) -> bool:
        return (
            self.point == point
            and (self.batch is None or self.batch == batch)
            and (self.snapshot is None or self.snapshot == snapshot)
            and (self.partition is None or self.partition == partition)
        )


@dataclass(frozen=True)
class FaultPlan:
    rules: tuple[FaultRule, ...] = ()

    @classmethod
    def parse(cls, spec: str | None) -> FaultPlan:
        if not spec:
            return cls()
        rules = []
        for part in spec.split(","):
            head, *conds = part.strip().split("@")
            point, _, action = head.partition(":")
            if point not in POINTS or action not in ACTIONS:
                raise ConfigError(
                    f"faultInjection rule {part!r}: expected point:action with point in "
                    f"{POINTS} and action in {ACTIONS}"
                )
            if action == "disconnect" and point not in DISCONNECT_POINTS:
                raise ConfigError(
                    f"faultInjection rule {part!r}: disconnect only at {DISCONNECT_POINTS}"
                )
            kw: dict[str, int] = {}
            for c in conds:
                key, _, value = c.partition("=")
                if key not in ("batch", "snapshot", "partition") or not value.isdigit():
                    raise ConfigError(
                        f"faultInjection rule {part!r}: condition {c!r} must be batch=N, "
                        "snapshot=N or partition=N"
                    )
                kw[key] = int(value)
            rules.append(FaultRule(point, action, **kw))
        return cls(tuple(rules))

    def hit(
        self,
        point: str,
        batch: int | None = None,
        *,
        snapshot: int | None = None,
        partition: int | None = None,
    ) -> bool:
        """Act on the first matching rule; True for ``disconnect`` (the caller acts)."""
        for rule in self.rules:
            if rule.matches(point, batch, snapshot, partition):
                log.error("fault injection: %s at %s (batch %s)", rule.action, point, batch)
                _note_fired(rule, point, batch, snapshot, partition)
                if rule.action == "exit":
                    os._exit(EXIT_CODE)
                if rule.action == "disconnect":
                    return True
                raise InjectedFault(f"injected fault at {point} (batch {batch})")
        return False


def _note_fired(
    rule: FaultRule, point: str, batch: int | None, snapshot: int | None, partition: int | None
) -> None:
    """Append ``point:action batch=B snapshot=S partition=P pid=N`` to the fault log, if
    one is set (tests read it to see which faults fired, in any process)."""
    path = os.environ.get(FAULT_LOG_ENV)
    if not path:
        return
    line = (
        f"{point}:{rule.action} batch={batch} snapshot={snapshot} partition={partition} "
        f"pid={os.getpid()}\n"
    )
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


NO_FAULTS = FaultPlan()
