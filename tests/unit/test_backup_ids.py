"""Backup ids and status aggregation (no Spark): ids grow, are never reused, one taker wins."""

import threading

import pytest
from support import run_cli_process

from pyspark_txn.errors import ConfigError
from pyspark_txn.operations import backups as b


def _members():
    return [b.Member("/chk/a", "/t/a", "sink-a", ())]


def _owner():
    owner = b._owner()
    b._LIVE.add(owner["token"])
    return owner


def test_aggregate_is_seed_001s():
    assert b.aggregate(["completed", "completed"]) == "completed"
    assert b.aggregate(["completed", "failed", "doesNotExist"]) == "failed"
    assert b.aggregate(["completed", "doesNotExist", "inProgress"]) == "incomplete"
    assert b.aggregate(["completed", "inProgress"]) == "inProgress"


def test_ids_grow_and_are_never_reused(tmp_path):
    to = str(tmp_path / "backups")
    assert b._allocate(to, None, _members(), _owner())[0] == 1
    assert b._allocate(to, 5, _members(), _owner())[0] == 5
    assert b._allocate(to, None, _members(), _owner())[0] == 6
    # 6's taker (this process, its token live) still runs: not resumable, and 3 < 6
    with pytest.raises(ConfigError, match="another process"):
        b._allocate(to, 6, _members(), _owner())
    with pytest.raises(ConfigError, match="highest so far in .* is 6"):
        b._allocate(to, 3, _members(), _owner())
    dt = b._open_catalog(to, create=False)
    b._append(dt, [b._event(6, "deleted", None, {})])
    with pytest.raises(ConfigError, match=r"is 6 \(backup 6 is deleted\)"):
        b._allocate(to, 6, _members(), _owner())


def test_two_takers_of_one_id_one_wins(tmp_path):
    to = str(tmp_path / "backups")
    b._allocate(to, None, _members(), _owner())  # the catalog exists
    results, barrier = [], threading.Barrier(4)

    def taker():
        barrier.wait()
        try:
            results.append(b._allocate(to, 2, _members(), _owner())[0])
        except ConfigError as e:
            results.append(str(e))

    threads = [threading.Thread(target=taker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(2) == 1, results
    started = [r for r in b._rows(b._open_catalog(to, create=False)) if r["event"] == "started"]
    assert [r["backup_id"] for r in started] == [1, 2]


def test_cli_refuses_a_bad_id_and_a_missing_catalog_in_one_line(tmp_path):
    code, out, err = run_cli_process("backups", "status", "3", "--to", str(tmp_path), "--json")
    assert code == 2 and "no backup catalog" in err and '"error"' in out
    code, out, err = run_cli_process("backups", "take", "0", "/nowhere", "--to", str(tmp_path))
    assert code == 2 and "must be a positive integer" in err


def test_delete_is_refused_while_the_taker_runs_and_the_id_stays_used(tmp_path):
    to = str(tmp_path / "backups")
    owner = _owner()
    backup_id, _ = b._allocate(to, None, _members(), owner)
    with pytest.raises(ConfigError, match="being taken now"):
        b.delete(backup_id, to)
    b._LIVE.discard(owner["token"])  # the taker has ended (it never took a part)
    assert b.delete(backup_id, to).state == "deleted"
    with pytest.raises(ConfigError, match="is 1 \\(backup 1 is deleted\\)"):
        b._allocate(to, 1, _members(), _owner())
    assert b._allocate(to, None, _members(), _owner())[0] == 2
