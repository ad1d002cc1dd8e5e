"""Random parameters for a workload family: traces of a family's shape that no policy was
tuned on, for checking that what holds on the defaults holds away from them."""

from __future__ import annotations

import dataclasses
import math
import random

#: Shape parameters, drawn uniformly from these ranges: popularity skews, the tail of
#: conversation lengths, and chances of a follow-up or of a lopsided phase.
SHAPE_RANGES: dict[str, tuple[float, float]] = {
    "zipf_s": (0.6, 1.4),
    "system_prompt_zipf_s": (0.6, 1.4),
    "turns_tail_index": (1.2, 2.8),
    "follow_up_probability": (0.05, 0.6),
    "share_concentration": (0.05, 0.6),
}
#: Parameters kept at their defaults: the caps on turns and context length, which stand for
#: the served model's limits rather than for the traffic, and the spreads of log-normal
#: draws, whose medians the other parameters already vary.
KEPT_PARAMETERS = frozenset({"max_turns", "max_context_tokens", "first_message_sigma",
                             "think_time_sigma"})
#: Every other positive number (a size, a count, a rate or a time) is its default times a
#: factor drawn log-uniformly between 1 / SCALE_RANGE and SCALE_RANGE.
SCALE_RANGE = 4.0


def random_parameters(workload_class: type, rng: random.Random) -> dict[str, int | float]:
    """Parameters for ``workload_class`` (a family's dataclass), drawn with ``rng`` as the
    module's constants say; fields that are not numbers (a mixture's families), and
    numbers whose default is 0 (a switch that is off), keep their defaults. Counts and
    token lengths stay whole numbers of at least 1. The same ``rng`` state gives the same
    parameters."""
    params: dict[str, int | float] = {}
    log_range = math.log(SCALE_RANGE)
    for field in dataclasses.fields(workload_class):
        default = field.default
        if field.name in SHAPE_RANGES:
            low, high = SHAPE_RANGES[field.name]
            params[field.name] = round(rng.uniform(low, high), 2)
        elif (field.name in KEPT_PARAMETERS or isinstance(default, bool)
              or not isinstance(default, int | float) or default <= 0):
            continue
        else:
            value = default * math.exp(rng.uniform(-log_range, log_range))
            params[field.name] = (max(1, round(value)) if isinstance(default, int)
                                  else round(value, 3))
    return params
