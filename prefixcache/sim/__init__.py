"""prefixcache.sim — trace replay and capacity planning over the real KV cache manager.

``trace`` reads request traces (Mooncake or Bailian hash ids, or token ids), ``merge``
merges several in order of arrival, ``expand`` turns them into token ids and block hashes,
``prepared`` hashes a trace once for many replays (each distinct hash stored once),
``replay`` drives :class:`~prefixcache.core.KVCacheManager` (sequential or timeline),
``belady`` is the offline-optimal free queue, ``dead_content`` the offline diagnostics
that know only which content is never used again, ``sweep`` builds hit-rate-vs-capacity
curves, ``reuse`` measures how predictable a trace's reuse is (what bounds every online
policy), ``report`` prints and plots the curves. The ``prefixcache replay`` and ``merge``
commands over them live in ``prefixcache.entrypoints`` (``replay_cmd``, ``merge_cmd``).
Depends on ``prefixcache.core`` only (plus tqdm and matplotlib, imported where used).
"""

from prefixcache.sim.belady import BeladyFreeBlockQueue, FutureUses
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import BlockHashChains, PreparedTrace, prepare_trace
from prefixcache.sim.replay import ReplayConfig, ReplayResult, policy_names, replay
from prefixcache.sim.reuse import ReuseHazard, reuse_hazard
from prefixcache.sim.sweep import SweepResult, infinite_cache_hit_rate, sweep
from prefixcache.sim.trace import Trace, TraceFormatError, TraceRequest, load_trace

__all__ = [
    "BeladyFreeBlockQueue",
    "BlockHashChains",
    "FutureUses",
    "PreparedTrace",
    "ReplayConfig",
    "ReplayResult",
    "ReuseHazard",
    "SweepResult",
    "Trace",
    "TraceExpander",
    "TraceFormatError",
    "TraceRequest",
    "infinite_cache_hit_rate",
    "load_trace",
    "policy_names",
    "prepare_trace",
    "replay",
    "reuse_hazard",
    "sweep",
]
