"""Garbage-collector settings for the long-running ``chatbridge run`` process.

With CPython's defaults (a young-generation pass every 700 net allocations, and full passes over every
object alive, all imported modules included) the collector took about a tenth of a turn's CPU under load
(tests/bench/core_overhead.py measures it). Once start-up is done, everything alive so far (modules,
config, connections) is frozen out of the collector's scans, and the young generation is collected every
100,000 allocations instead. Reference counting still frees almost everything at once; the collector only
has to find reference cycles, and those now wait a little longer.

Why 100,000: a streaming turn keeps a few hundred objects alive for its whole length (its tasks, coroutines,
snapshot, the SDK's request), so with a thousand turns at once nearly everything a young pass looks at
survives it and is looked at again by the middle generation's pass. Counted inside the bridge
(``gc.callbacks``) at 1,000 chats on Slack (``tests.bench.e2e``): every 10,000 allocations the collector
took 0.69 ms a turn (44 young passes, 4 middle ones); every 30,000, 0.36 ms; every 100,000, 0.21 ms (four
young passes, no middle one), while the cycles it found stayed a few thousand objects a run.
"""

from __future__ import annotations

import gc

YOUNG_GENERATION_THRESHOLD = 100_000


def tune_gc() -> None:
    """Call once, after start-up."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, middle, old)
