"""From trace requests to what the KV cache manager sees: prompt token ids and block hashes.

Mooncake requests name 512-token blocks by hash id, Bailian requests 16-token blocks (the
request's ``hash_block_size``, ``H``). :class:`TraceExpander` turns each id into a
deterministic pseudo-random block of ``H`` token ids (the same id always gives the same
tokens, so the replay sees exactly the trace's prefix sharing; ids of the two formats are
different blocks) and builds a prompt as follows, for a block size ``B`` dividing ``H`` or
a multiple of it:

* the prompt's first ``input_length // B * B`` tokens are the id blocks' tokens, in order
  (so ``B = 16`` splits every Mooncake block into 32 sub-blocks, and the full sub-blocks
  at the start of a trailing partial trace block are shared by every request naming that
  id; ``B = 512`` joins 32 Bailian blocks into one);
* the trailing ``input_length % B`` tokens are unique to the request (seeded by its line
  number), since no one else can share a partial block.

Hashing a long trace dominates a replay, so block hashes are computed here once and handed
to every replay: equal ``(parent hash, hash id)`` pairs share one computed run of sub-block
hashes. They are exactly the hashes the manager's own :class:`BlockHasher` of the same
configuration would compute from the token ids (a test checks this).
"""

from __future__ import annotations

import hashlib
from array import array

from prefixcache.core import BlockHash, BlockHasher, resolve_hash_seed
from prefixcache.sim.trace import MOONCAKE_BLOCK_SIZE, TraceRequest

# Each size's token blocks are seeded apart: a Mooncake id and a Bailian id that happen
# to be equal name unrelated content. (Mooncake's key is the one it always had, so its
# tokens, and every replay's figures, stay as they were.)
_TOKEN_KEY_KINDS = {MOONCAKE_BLOCK_SIZE: "block"}


def _pseudo_random_tokens(key: str, num_tokens: int) -> bytes:
    """``num_tokens`` token ids in [0, 65536) as native uint16 bytes, a pure function of
    ``key``."""
    return hashlib.shake_128(key.encode()).digest(2 * num_tokens)


def _uint16_to_list(data: bytes) -> list[int]:
    return array("H", data).tolist()


def block_sizes_fit(block_size: int, trace_block_size: int) -> bool:
    """Whether a trace's hash ids of ``trace_block_size`` tokens expand into blocks of
    ``block_size``: one size divides the other (each id is then split, or whole ids are
    joined)."""
    return not (trace_block_size % block_size and block_size % trace_block_size)


class TraceExpander:
    """Token ids and block hashes of trace requests for one block size and hash config.

    ``token_seed`` varies the synthetic token content (not the sharing structure).
    Token blocks and hash runs are cached per hash id, so expanding a whole trace costs
    one hash per distinct (prefix, sub-block).
    """

    def __init__(self, block_size: int, hash_algo: str = "sha256",
                 hash_seed: str | None = None, token_seed: int = 0) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.hash_algo = hash_algo
        # Resolved once, so every manager built for this expander hashes identically (the
        # xxhash algorithms would otherwise draw a random seed per manager).
        self.hash_seed = resolve_hash_seed(hash_algo, hash_seed)
        self.block_hasher = BlockHasher(block_size, hash_algo, self.hash_seed)
        self.token_seed = token_seed
        self._id_to_token_bytes: dict[tuple[int, int], bytes] = {}
        # Per size of the trace's blocks (a Mooncake id and a Bailian id may be equal):
        # (parent hash, the hash id of one run, or its ids if several) -> its hashes.
        self._runs_by_size: dict[int, dict[
            tuple[BlockHash | None, int | tuple[int, ...]], list[BlockHash]]] = {}

    def check_supports(self, request: TraceRequest) -> None:
        """Raise ValueError when this block size cannot expand ``request``."""
        if request.hash_ids is None:
            return
        size, block_size = request.hash_block_size, self.block_size
        if not block_sizes_fit(block_size, size):
            if size == MOONCAKE_BLOCK_SIZE:
                raise ValueError(
                    f"block size {block_size} does not divide the Mooncake block size "
                    f"{size} (nor is a multiple of it); choose a divisor such as 16, 32, "
                    "64, 128, 256 or 512"
                )
            fitting = sorted({part for part in (size // 4, size // 2)
                              if part and size % part == 0} | {size, 2 * size})
            raise ValueError(
                f"block size {block_size} neither divides nor is a multiple of the trace's "
                f"{size}-token blocks (line {request.line_no}); choose such as "
                f"{', '.join(map(str, fitting[:-1]))} or {fitting[-1]}"
            )

    # -- tokens -------------------------------------------------------------------------

    def token_block_bytes(self, hash_id: int,
                          size: int = MOONCAKE_BLOCK_SIZE) -> bytes:
        """The ``size`` token ids of a trace's ``size``-token block ``hash_id`` as uint16
        bytes (cached)."""
        key = (size, hash_id)
        data = self._id_to_token_bytes.get(key)
        if data is None:
            kind = _TOKEN_KEY_KINDS.get(size, f"block{size}")
            data = _pseudo_random_tokens(f"{self.token_seed}:{kind}:{hash_id}", size)
            self._id_to_token_bytes[key] = data
        return data

    def token_block(self, hash_id: int, size: int = MOONCAKE_BLOCK_SIZE) -> list[int]:
        """The ``size`` token ids of a trace's ``size``-token block ``hash_id``."""
        return _uint16_to_list(self.token_block_bytes(hash_id, size))

    def prompt_token_ids(self, request: TraceRequest) -> list[int]:
        """The request's ``input_length`` prompt token ids (see the module docstring)."""
        if request.token_ids is not None:
            return list(request.token_ids)
        num_shared_tokens = request.input_length // self.block_size * self.block_size
        block_bytes, size = self.token_block_bytes, request.hash_block_size
        shared = b"".join([block_bytes(h, size)
                           for h in request.hash_ids])[:2 * num_shared_tokens]
        num_unique_tokens = request.input_length - num_shared_tokens
        if num_unique_tokens:
            shared += _pseudo_random_tokens(f"{self.token_seed}:line:{request.line_no}",
                                            num_unique_tokens)
        return _uint16_to_list(shared)

    # -- hashes -------------------------------------------------------------------------

    def block_hashes(self, request: TraceRequest) -> list[BlockHash]:
        """Chained hashes of the request's ``input_length // block_size`` full blocks."""
        if request.token_ids is not None:
            return self.block_hasher.hash_blocks(None, request.token_ids)
        runs, num_full_blocks = self.block_hash_runs(request)
        hashes = [block_hash for run in runs for block_hash in run]
        del hashes[num_full_blocks:]  # the trailing trace block may be partial
        return hashes

    def block_hash_runs(self, request: TraceRequest) -> tuple[list[list[BlockHash]], int]:
        """A hash-id request's chain as runs, and its number of full blocks: the chain is
        the runs' concatenation cut to that length. A run covers the ids of about 512
        tokens of whole blocks (one Mooncake id's sub-blocks; 32 Bailian ids, or the ids of
        one block larger than that) and holds their hashes; a prompt's last run may cover
        fewer ids.

        A run is the memoised list of its ids' hashes after its parent, the same object
        for every request with the same prefix up to it. (Runs of different ids after the
        same parent may still begin with equal hashes: at block sizes of 1 or 2, two ids'
        pseudo-random blocks can start with the same tokens.)
        Raises ValueError for a token-id request, or one this block size cannot split.
        """
        if request.hash_ids is None:
            raise ValueError("only a hash-id request has hash-id runs")
        self.check_supports(request)
        size = request.hash_block_size
        # A run covers whole blocks, about 512 tokens of them (a Mooncake id's), so a
        # trace of small ids is memoised in as few runs as a Mooncake trace: one per
        # 16-token id would cost a run, a key and a cached list per block.
        block_size = self.block_size
        ids_per_run = max(1, block_size * max(1, MOONCAKE_BLOCK_SIZE // block_size) // size)
        num_full_blocks = request.input_length // block_size
        runs: list[list[BlockHash]] = []
        memo = self._runs_by_size.setdefault(size, {})
        parent = None
        num_hashes = 0
        hash_ids = request.hash_ids
        for start in range(0, len(hash_ids), ids_per_run):
            if num_hashes >= num_full_blocks:
                break
            # One id is its own key (no tuple to build per id of a long trace).
            run_ids = (hash_ids[start] if ids_per_run == 1
                       else hash_ids[start:start + ids_per_run])
            run = memo.get((parent, run_ids))
            if run is None:
                tokens = (self.token_block_bytes(run_ids, size) if ids_per_run == 1
                          else b"".join([self.token_block_bytes(h, size) for h in run_ids]))
                run = self.block_hasher.hash_blocks(parent, _uint16_to_list(tokens))
                memo[(parent, run_ids)] = run
            runs.append(run)
            num_hashes += len(run)
            parent = run[-1]
        return runs, num_full_blocks
