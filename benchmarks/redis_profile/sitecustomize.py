"""Step timings for ``benchmarks/redis_source.py --profile DIR`` (benchmark only).

On ``PYTHONPATH`` of Spark's Python workers (the benchmark puts it there), this
wraps the ``txn-redis`` reader and the ``txn-delta`` writer and appends one JSON
line per call to ``$TXN_REDIS_BENCH_PROFILE/steps-<pid>.jsonl``: wall time,
CPU time of the process, and for the generator/iterator hops the time spent
producing vs. waiting for the other side. With ``TXN_REDIS_BENCH_CPROFILE=1``
each read and write task also dumps a cProfile file there.
"""

from __future__ import annotations

import os

if os.environ.get("TXN_REDIS_BENCH_PROFILE"):
    try:
        import redis_profile_hooks

        redis_profile_hooks.install()
    except Exception:  # a benchmark aid: never break the worker
        import traceback

        traceback.print_exc()
