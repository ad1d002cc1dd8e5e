"""Per-signature reuse rates of newly cached content, counted online with decay.

A *signature* is any hashable summary of a finished request (``adaptive`` uses
:func:`~prefixcache.core.eviction.learned_reuse.output_length_signature`). The caller
reports the new content each signature inserts and every later look-up of it; the
estimate says which signatures' new content is looked up again much less often than
content overall.
"""

from __future__ import annotations

from collections.abc import Hashable


class SignatureReuseEstimate:
    """Decayed counts of inserted and reused blocks per signature.

    Contract:

    - :meth:`insert` counts ``num_blocks`` new blocks of a signature and returns the
      *epoch* to hand back to :meth:`credit` when one of them is looked up again; a
      reuse is credited with the weight its insertion has left.
    - Whenever the inserted total passes ``memory_blocks``, every count is halved (the
      epoch advances), so the estimates follow traffic that changes.
    - :meth:`reuse_rate` is ``(reused + prior_weight * g) / (inserted + prior_weight)``,
      shrunk towards the overall rate ``g`` (1/2 with no data); :meth:`is_low_reuse` is
      whether that falls below ``low_reuse_ratio * g``. With no history nothing is low.
    """

    __slots__ = ("memory_blocks", "prior_weight", "low_reuse_ratio", "num_inserted",
                 "num_reused", "total_inserted", "total_reused", "epoch")

    def __init__(self, memory_blocks: float, prior_weight: float = 4.0,
                 low_reuse_ratio: float = 0.5) -> None:
        self.memory_blocks = max(1.0, memory_blocks)
        self.prior_weight = prior_weight
        self.low_reuse_ratio = low_reuse_ratio
        self.num_inserted: dict[Hashable, float] = {}
        self.num_reused: dict[Hashable, float] = {}
        self.total_inserted = 0.0
        self.total_reused = 0.0
        self.epoch = 0

    def insert(self, signature: Hashable, num_blocks: int) -> int:
        """Count ``num_blocks`` new blocks of ``signature``; returns the current epoch."""
        self.num_inserted[signature] = self.num_inserted.get(signature, 0.0) + num_blocks
        self.total_inserted += num_blocks
        if self.total_inserted > self.memory_blocks:
            for counts in (self.num_inserted, self.num_reused):
                for key in counts:
                    counts[key] /= 2.0
            self.total_inserted /= 2.0
            self.total_reused /= 2.0
            self.epoch += 1
        return self.epoch

    def credit(self, signature: Hashable, epoch: int, num_blocks: int = 1) -> None:
        """``num_blocks`` blocks of ``signature``, inserted at ``epoch``, were looked up
        again."""
        weight = num_blocks * 0.5 ** (self.epoch - epoch)
        self.num_reused[signature] = self.num_reused.get(signature, 0.0) + weight
        self.total_reused += weight

    def overall_reuse_rate(self) -> float:
        return (self.total_reused + 1.0) / (self.total_inserted + 2.0)

    def reuse_rate(self, signature: Hashable) -> float:
        prior = self.prior_weight
        return ((self.num_reused.get(signature, 0.0) + prior * self.overall_reuse_rate())
                / (self.num_inserted.get(signature, 0.0) + prior))

    def is_low_reuse(self, signature: Hashable) -> bool:
        overall = self.overall_reuse_rate()
        prior = self.prior_weight
        rate = ((self.num_reused.get(signature, 0.0) + prior * overall)
                / (self.num_inserted.get(signature, 0.0) + prior))
        return rate < self.low_reuse_ratio * overall
