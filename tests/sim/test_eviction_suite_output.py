"""The figures ``benchmarks/eviction_suite.py`` reports, from hit-rate curves given by
hand: the widest gap, the share of it closed, the least margin over LRU, the summary of
the random traces and the leave-one-out choice of a variant."""

from __future__ import annotations

import pytest

from benchmarks.eviction_suite_output import (
    LOFO_TOLERANCE_POINTS,
    gap_figures,
    gaps_and_widest,
    leave_one_out,
    lofo_score,
    random_traces_summary,
)


def test_the_widest_gap_is_the_first_of_equal_ones():
    gaps, widest = gaps_and_widest([0.1, 0.2, 0.3, 0.4], [0.3, 0.5, 0.6, 0.5])
    assert gaps == pytest.approx([0.2, 0.3, 0.3, 0.1])
    assert widest == 1


def test_gap_figures_are_the_share_closed_where_widest_and_the_least_margin_anywhere():
    figures = gap_figures([0.1, 0.2, 0.4], [0.3, 0.6, 0.5], [0.15, 0.3, 0.38])
    assert figures["fraction_of_gap_closed"] == pytest.approx(0.25)
    assert figures["min_minus_lru_points"] == pytest.approx(-2.0)


def figures(closed: float | None, margin: float) -> dict:
    return {"fraction_of_gap_closed": closed, "min_minus_lru_points": margin}


def test_a_variant_scores_its_share_closed_less_one_where_it_falls_below_lru():
    assert lofo_score(figures(0.3, -LOFO_TOLERANCE_POINTS)) == 0.3  # within tolerance
    assert lofo_score(figures(0.3, -LOFO_TOLERANCE_POINTS - 0.01)) == pytest.approx(-0.7)
    assert lofo_score(figures(None, 0.0)) == 0.0


def test_leave_one_out_chooses_for_each_trace_the_variant_best_on_the_others():
    per_variant = {
        # Best on trace x alone: chosen for y and z, never for x itself.
        "sharp": {"x": figures(0.9, 0.0), "y": figures(0.2, 0.0), "z": figures(0.2, 0.0)},
        "steady": {"x": figures(0.1, 0.0), "y": figures(0.3, 0.0), "z": figures(0.3, 0.0)},
        # Closes most on y and z but falls below LRU on x: its score there costs a point.
        "risky": {"x": figures(0.5, -1.0), "y": figures(0.35, 0.0), "z": figures(0.35, 0.0)},
    }
    report = leave_one_out(per_variant)
    assert report["x"]["chosen_variant"] == "risky"
    assert report["x"]["fraction_of_gap_closed"] == 0.5
    assert report["y"]["chosen_variant"] == report["z"]["chosen_variant"] == "sharp"


def trace(lru: list[float], belady: list[float], **others: list[float]) -> dict:
    return {"policy_hit_rates": {"lru": lru, **others}, "belady_hit_rates": belady}


def test_the_random_traces_summary_counts_each_policy_against_lru():
    traces = [
        # A quarter of the gap exactly, and 0.2 points below LRU: within tolerance.
        trace([0.1, 0.5], [0.5, 0.6], adaptive=[0.2, 0.498]),
        # Half the gap, and 1 point below LRU somewhere.
        trace([0.1, 0.5], [0.5, 0.6], adaptive=[0.3, 0.49]),
        # A tenth of the gap.
        trace([0.2, 0.5], [0.4, 0.6], adaptive=[0.22, 0.55]),
    ]
    summary = random_traces_summary(traces)
    assert summary["num_traces"] == 3
    adaptive = summary["by_policy"]["adaptive"]
    assert adaptive["num_closing_a_quarter_of_widest_gap"] == 2
    assert adaptive["num_below_lru_by_more_than_tolerance"] == 1
    assert adaptive["least_minus_lru_points"] == pytest.approx(-1.0)
    assert adaptive["median_fraction_of_widest_gap_closed"] == pytest.approx(0.25)
