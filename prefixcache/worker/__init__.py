"""prefixcache.worker: executes scheduled steps on the model over a paged KV cache.

- `scheduled_sequence.ScheduledSequence`: the scheduler -> runner hand-off.
- `model_runner.ModelRunner`: owns the per-layer K/V tensors, builds step inputs, runs.
- `kv_cache_memory`: how many blocks fit in a byte budget.
"""
