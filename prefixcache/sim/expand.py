"""From trace requests to what the KV cache manager sees: prompt token ids and block hashes.

Mooncake requests name 512-token blocks by hash id. :class:`TraceExpander` turns each id
into a deterministic pseudo-random block of 512 token ids (the same id always gives the
same tokens, so the replay sees exactly the trace's prefix sharing) and builds a prompt as
follows, for a block size ``B`` dividing 512:

* the prompt's first ``input_length // B * B`` tokens are the id blocks' tokens, in order
  (so ``B = 16`` splits every trace block into 32 sub-blocks, and the full sub-blocks at
  the start of a trailing partial trace block are shared by every request naming that id);
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


def _pseudo_random_tokens(key: str, num_tokens: int) -> bytes:
    """``num_tokens`` token ids in [0, 65536) as native uint16 bytes, a pure function of
    ``key``."""
    return hashlib.shake_128(key.encode()).digest(2 * num_tokens)


def _uint16_to_list(data: bytes) -> list[int]:
    return array("H", data).tolist()


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
        self._id_to_token_bytes: dict[int, bytes] = {}
        self._parent_and_id_to_hashes: dict[tuple[BlockHash | None, int], list[BlockHash]] = {}

    def check_supports(self, request: TraceRequest) -> None:
        """Raise ValueError when this block size cannot expand ``request``."""
        if request.hash_ids is not None and MOONCAKE_BLOCK_SIZE % self.block_size:
            raise ValueError(
                f"block size {self.block_size} does not divide the Mooncake block size "
                f"{MOONCAKE_BLOCK_SIZE}; choose a divisor such as 16, 32, 64, 128, 256 or 512"
            )

    # -- tokens -------------------------------------------------------------------------

    def token_block_bytes(self, hash_id: int) -> bytes:
        """The 512 token ids of trace block ``hash_id`` as uint16 bytes (cached)."""
        data = self._id_to_token_bytes.get(hash_id)
        if data is None:
            data = _pseudo_random_tokens(f"{self.token_seed}:block:{hash_id}",
                                         MOONCAKE_BLOCK_SIZE)
            self._id_to_token_bytes[hash_id] = data
        return data

    def token_block(self, hash_id: int) -> list[int]:
        """The 512 token ids of trace block ``hash_id``."""
        return _uint16_to_list(self.token_block_bytes(hash_id))

    def prompt_token_ids(self, request: TraceRequest) -> list[int]:
        """The request's ``input_length`` prompt token ids (see the module docstring)."""
        if request.token_ids is not None:
            return list(request.token_ids)
        num_shared_tokens = request.input_length // self.block_size * self.block_size
        block_bytes = self.token_block_bytes
        shared = b"".join([block_bytes(h) for h in request.hash_ids])[:2 * num_shared_tokens]
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
        """A Mooncake request's chain as runs, one per hash id it reaches, and its number of
        full blocks: the chain is the runs' concatenation cut to that length.

        A run is the memoised list of its hash id's sub-block hashes after its parent, the
        same object for every request with the same prefix up to it. (Runs of different
        ids after the same parent may still begin with equal hashes: at block sizes of 1
        or 2, two ids' pseudo-random blocks can start with the same tokens.)
        Raises ValueError for a token-id request, or one this block size cannot split.
        """
        if request.hash_ids is None:
            raise ValueError("only a Mooncake request has hash-id runs")
        self.check_supports(request)
        num_full_blocks = request.input_length // self.block_size
        runs: list[list[BlockHash]] = []
        memo = self._parent_and_id_to_hashes
        parent = None
        num_hashes = 0
        for hash_id in request.hash_ids:
            if num_hashes >= num_full_blocks:
                break
            run = memo.get((parent, hash_id))
            if run is None:
                run = self.block_hasher.hash_blocks(parent, self.token_block(hash_id))
                memo[(parent, hash_id)] = run
            runs.append(run)
            num_hashes += len(run)
            parent = run[-1]
        return runs, num_full_blocks
