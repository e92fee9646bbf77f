"""Garbage-collector settings for the long-running ``chatbridge run`` process.

With CPython's defaults (a young-generation pass every 700 net allocations, and full passes over every
object alive, all imported modules included) the collector took about a tenth of a turn's CPU under load
(tests/bench/core_overhead.py measures it). Once start-up is done, everything alive so far (modules,
config, connections) is frozen out of the collector's scans, and the young generation is collected every
10,000 allocations instead. Reference counting still frees almost everything at once; the collector only
has to find reference cycles, and those now wait a little longer.
"""

from __future__ import annotations

import gc

YOUNG_GENERATION_THRESHOLD = 10_000


def tune_gc() -> None:
    """Call once, after start-up."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, middle, old)
