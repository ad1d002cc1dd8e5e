"""Random workload parameters: valid for their family, within the documented ranges, and
a function of the generator's state."""

from __future__ import annotations

import dataclasses
import random

import pytest

from prefixcache.sim.workloads import WORKLOAD_FAMILIES, generate_requests
from prefixcache.sim.workloads.random_parameters import (
    KEPT_PARAMETERS,
    SCALE_RANGE,
    SHAPE_RANGES,
    random_parameters,
)


@pytest.mark.parametrize("family", WORKLOAD_FAMILIES)
def test_drawn_parameters_stay_in_their_ranges_and_give_a_trace(family):
    workload_class = WORKLOAD_FAMILIES[family]
    defaults = {field.name: field.default for field in dataclasses.fields(workload_class)}
    rng = random.Random(7)
    for _ in range(20):
        params = random_parameters(workload_class, rng)
        assert params, family
        for name, value in params.items():
            assert name not in KEPT_PARAMETERS
            if name in SHAPE_RANGES:
                low, high = SHAPE_RANGES[name]
                assert low <= value <= high, (name, value)
            else:
                default = defaults[name]
                assert type(value) is type(default), (name, value)
                low, high = default / SCALE_RANGE, default * SCALE_RANGE
                if isinstance(default, int):  # rounded, and kept at 1 or more
                    low, high = max(1, round(low)), round(high)
                assert low - 0.001 <= value <= high + 0.001, (name, value)
        requests = generate_requests(family, 3, 30, **params)
        assert len(requests) == 30


def test_switches_that_are_off_and_nested_families_keep_their_defaults():
    # rag's popularity drift is off (0) by default; a mixture's families are dataclasses.
    assert "popularity_drift_every" not in random_parameters(WORKLOAD_FAMILIES["rag"],
                                                             random.Random(1))
    mixture = random_parameters(WORKLOAD_FAMILIES["mixture"], random.Random(1))
    assert set(mixture) == {"num_phases", "share_concentration", "popularity_drift_every",
                            "requests_per_s"}


def test_the_same_generator_state_gives_the_same_parameters():
    chat = WORKLOAD_FAMILIES["chat"]
    assert random_parameters(chat, random.Random(5)) == random_parameters(chat, random.Random(5))
    assert random_parameters(chat, random.Random(5)) != random_parameters(chat, random.Random(6))
