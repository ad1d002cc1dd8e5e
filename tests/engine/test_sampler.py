"""The sampler on hand-made logits: greedy, top-k, top-p, temperature, seeds."""

from __future__ import annotations

import pytest
import torch

from prefixcache.engine.sampler import Sampler
from prefixcache.engine.sampling_params import SamplingParams

VOCAB = 50


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits(4)
    tokens = Sampler(seed=0).sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert tokens == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [1e-6, 1e-20, 1e-39, 5e-46])
def test_a_vanishing_temperature_is_greedy_not_nan(temperature):
    # Logits of a real model's size: dividing them by 1e-39 overflows float32.
    logits = random_logits(4) * 12
    params = [SamplingParams(temperature=temperature)] * 4
    tokens = Sampler(seed=0).sample(logits, params, [None] * 4)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_1_equals_greedy_at_any_temperature():
    logits = random_logits(6)
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.1, 0.5, 1.0, 2.0, 5.0, 50.0)]
    tokens = Sampler(seed=0).sample(logits, params, [None] * 6)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_samples_only_the_k_most_likely():
    logits = random_logits(1)
    allowed = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(seed=0)
    params = [SamplingParams(temperature=100.0, top_k=3)]  # nearly uniform within the top 3
    seen = {sampler.sample(logits, params, [None])[0] for _ in range(200)}
    assert seen == allowed


def test_top_p_keeps_the_smallest_nucleus():
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.8 keeps exactly the first two.
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    sampler = Sampler(seed=0)
    params = [SamplingParams(temperature=1.0, top_p=0.8)]
    seen = {sampler.sample(logits, params, [None])[0] for _ in range(300)}
    assert seen == {0, 1}
    params = [SamplingParams(temperature=1.0, top_p=0.81)]
    seen = {sampler.sample(logits, params, [None])[0] for _ in range(300)}
    assert seen == {0, 1, 2}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([[0.6, 0.3, 0.1]])
    sampler = Sampler(seed=1)
    params = [SamplingParams(temperature=1.0)]
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sampler.sample(probs.log(), params, [None])[0]] += 1
    assert torch.allclose(counts / 3000, probs[0], atol=0.04)


def test_a_seeded_row_does_not_depend_on_its_batch():
    logits = random_logits(5)
    target = logits[2:3]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def draws(make_batch):
        generator = torch.Generator().manual_seed(params.seed)
        sampler = Sampler(seed=99)
        return [make_batch(sampler, generator) for _ in range(20)]

    alone = draws(lambda s, g: s.sample(target, [params], [g])[0])
    others = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0),
              SamplingParams(temperature=1.5), SamplingParams(temperature=1.0, top_p=0.5)]
    in_batch = draws(lambda s, g: s.sample(
        logits, [others[0], others[1], params, others[2], others[3]],
        [None, None, g, None, None])[2])
    assert alone == in_batch
    assert len(set(alone)) > 1  # it really sampled


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("max_tokens", 0), ("seed", "x"), ("stop", [""]), ("stop", [1]), ("stop_token_ids", [-1]),
    ("ignore_eos", "yes"), ("temperature", float("nan")), ("temperature", float("inf")),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("stop_token_ids", 7), ("stop_token_ids", "7"),
])
def test_invalid_params_are_clear_errors(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_valid_params_pass():
    SamplingParams(n=2, temperature=0, top_p=0.5, top_k=-1, seed=0, max_tokens=1,
                   stop="x", stop_token_ids=[0], ignore_eos=True).validate()
    for seed in (2**63 - 1, -(2**63)):
        SamplingParams(seed=seed).validate()
    assert SamplingParams(stop="ab").stop_strings == ("ab",)
