"""Turning one step's logits into tokens: greedy, temperature, top-k, top-p, seeds.

Every row is processed in the vocabulary's own order (filters are computed on a sorted copy
and scattered back), and a seeded row draws its noise from its own generator, so a seeded
request's tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixcache.engine.sampling_params import SamplingParams


class Sampler:
    """Samples one token per logits row.

    Sampling uses the exponential-race form of the categorical draw: the argmax of
    ``probs / E`` with ``E ~ Exp(1)`` i.i.d. is distributed as ``probs`` — one vectorised
    draw per row, and a row with its own generator draws its own ``E``. Unseeded rows share
    the engine's generator (seeded by the engine's ``seed`` when given).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """logits [N, vocab] float32, one params and generator (or None) per row.
        Returns N token ids."""
        num_rows = logits.shape[0]
        if num_rows == 0:
            return []
        token_ids = logits.argmax(dim=-1)  # [N]; final for greedy rows
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            return token_ids.tolist()
        rows = torch.tensor(random_rows, dtype=torch.int64)
        temperatures = torch.tensor([params[i].temperature for i in random_rows],
                                    dtype=torch.float32)
        scaled = logits[rows] / temperatures[:, None]  # [R, vocab]
        top_ks = [_top_k(params[i].top_k, scaled.shape[1]) for i in random_rows]
        top_ps = [params[i].top_p for i in random_rows]
        if any(k < scaled.shape[1] for k in top_ks) or any(p < 1.0 for p in top_ps):
            scaled = _apply_top_k_top_p(scaled, top_ks, top_ps)
        probs = torch.softmax(scaled, dim=-1)  # [R, vocab]
        noise = torch.empty_like(probs)
        shared_rows = []
        for r, i in enumerate(random_rows):
            generator = generators[i]
            if generator is None:
                shared_rows.append(r)
            else:
                noise[r].exponential_(generator=generator)
        if shared_rows:
            shared = torch.empty(len(shared_rows), probs.shape[1])
            shared.exponential_(generator=self.generator)
            noise[shared_rows] = shared
        sampled = (probs / noise).argmax(dim=-1)  # [R]
        token_ids[rows] = sampled
        return token_ids.tolist()


def _top_k(top_k: int, vocab_size: int) -> int:
    return vocab_size if top_k <= 0 else min(top_k, vocab_size)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_ks: list[int], top_ps: list[float]
) -> torch.Tensor:
    """Set to -inf every logit outside its row's top-k, then outside its top-p nucleus
    (the smallest most-likely set whose probability reaches p; the top token always stays)."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [R, vocab]
    ranks = torch.arange(logits.shape[1])[None, :]  # [1, vocab]
    remove = ranks >= torch.tensor(top_ks)[:, None]  # [R, vocab]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Probability of everything ranked above each token: once it reaches p, drop the token.
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p = 1 must filter nothing, not even what float rounding of the cumsum would.
    thresholds = torch.tensor([p if p < 1.0 else float("inf") for p in top_ps])
    remove |= mass_before >= thresholds[:, None]
    remove[:, 0] = False
    remove_in_vocab_order = torch.zeros_like(remove).scatter_(1, sorted_ids, remove)
    return logits.masked_fill(remove_in_vocab_order, float("-inf"))
