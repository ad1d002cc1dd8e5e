"""Tests of the KV event layer (prefixcache.events)."""

# vLLM's own numbering (the first batch is seq 0, no startup AllBlocksCleared): for tests
# that count batches from 0.
VLLM_NUMBERING = {"first_seq": 0, "clear_on_start": False}
