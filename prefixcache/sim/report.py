"""Human-readable tables and the hit-rate-vs-capacity plot of replays and sweeps."""

from __future__ import annotations

import os
import shutil

from prefixcache.sim.replay import ReplayResult
from prefixcache.sim.sweep import SweepResult

GIB = 1 << 30
DEFAULT_PLOT_FORMAT = "png"
# Formats matplotlib lists but writes only through Pillow, when Pillow was built with them.
_PILLOW_FORMATS = ("webp", "avif")


def capacity_gib(num_blocks: int, block_size: int, kv_bytes_per_token: int) -> float:
    return num_blocks * block_size * kv_bytes_per_token / GIB


def format_replay(result: ReplayResult, kv_bytes_per_token: int) -> str:
    """One replay's figures as an aligned two-column table."""
    gib = capacity_gib(result.num_blocks, result.block_size, kv_bytes_per_token)
    mode = result.mode if result.concurrency is None else \
        f"{result.mode}, concurrency {result.concurrency}"
    rows = [
        ("policy", result.policy),
        ("cache", f"{result.num_blocks:,} blocks x {result.block_size} tokens "
                  f"({gib:.2f} GiB of KV)"),
        ("mode", mode),
        ("requests", f"{result.num_requests:,}"),
        ("  not admitted (rejected)", f"{result.num_rejected_requests:,}"),
        ("  delayed (waited for room)", f"{result.num_delayed_requests:,}"),
        ("prompt tokens", f"{result.num_prompt_tokens:,}"),
        ("hit tokens", f"{result.num_hit_tokens:,}"),
        ("token hit rate", f"{100 * result.hit_rate:.2f} %"),
        ("evictions", f"{result.num_evictions:,}"),
        ("peak usage", f"{100 * result.peak_usage:.1f} %"),
        ("mean usage", f"{100 * result.mean_usage:.1f} %"),
    ]
    if result.mean_wait_s is not None:
        rows.append(("mean wait", f"{result.mean_wait_s:.3f} s"))
    rows += [
        ("replay time", f"{result.replay_seconds:.2f} s"),
        ("replay throughput", f"{result.requests_per_s:,.0f} requests/s, "
                              f"{result.blocks_per_s:,.0f} blocks/s"),
    ]
    width = max(len(name) for name, _ in rows)
    text = "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
    state = result.policy_state
    if state is not None:
        if "classes" in state:
            text += "\n\n" + format_document_liveness(state)
        elif "candidate_hit_shares" in state:
            text += "\n\n" + format_adaptive(state)
        else:
            text += "\n\n" + format_learned_reuse(state)
    return text


def format_adaptive(state: dict) -> str:
    """adaptive's choice: the candidate order it follows at the end (protected share,
    whether low-reuse content goes first, the ghost list's reach), each candidate's part
    of the hits its shadow cache counted (decayed), and, over the whole replay, how often
    the order followed changed and each candidate's part of the requests it was followed
    for (those never followed left out)."""
    shares = ", ".join(f"{label}: {part:.1%}"
                       for label, part in state["candidate_hit_shares"].items())
    low_reuse = ", low-reuse content first" if state.get("low_reuse_first") else ""
    segments = (f"protected share {state['protected_fraction']:.0%}{low_reuse}, "
                f"ghost {state['ghost_factor']}x")
    followed = (f"the document liveness order (segments kept: {segments})"
                if state.get("liveness_order") else segments)
    switches = state["switches"]
    followed_for = ", ".join(f"{label}: {part:.1%}" for label, part
                             in state["candidate_followed_shares"].items() if part > 0)
    return (f"adaptive: {followed} at the end; shadow hits by candidate: {shares}\n"
            f"adaptive over the replay: {switches:,} switch{'' if switches == 1 else 'es'}; "
            f"followed for (share of requests): {followed_for}")


def format_learned_reuse(state: dict) -> str:
    """learned-reuse's table: per range of generated tokens, the new content its requests
    cached, how much of it was looked up again, and whether it is now evicted first."""
    lines = [f"learned-reuse: new content by tokens generated (overall reuse rate "
             f"{100 * state['overall_reuse_rate']:.1f} %; counts decay)",
             f"{'tokens generated':>16}  {'blocks':>9}  {'reused':>9}  {'estimate':>8}  "
             f"evicted first"]
    for row in state["signatures"]:
        low, high = row["output_tokens"]
        tokens = str(low) if low == high else f"{low}-{high}"
        lines.append(f"{tokens:>16}  {row['inserted']:>9,.0f}  {row['reused']:>9,.0f}  "
                     f"{100 * row['estimated_reuse_rate']:>7.1f}%  "
                     f"{'yes' if row['evicted_first'] else 'no'}")
    return "\n".join(lines)


def format_document_liveness(state: dict) -> str:
    """document-liveness's models: per class of document (and of conversation, where it
    follows them), the states seen (one having just had a request), how many were
    followed by another request so far, and the estimated chance of another request
    (which counts the silences too)."""
    lines = [f"document-liveness: chance a document is asked about again (overall "
             f"{100 * state['overall_continuation_probability']:.1f} %; a live document's "
             f"next request comes every ~{state['requests_between_a_documents_requests']:,.0f}"
             f" requests; silence counts {state['clock_over_fitted_rate']:.2f}x that rate)",
             *_liveness_class_rows(state["classes"])]
    conversations = state.get("conversations")
    if conversations is not None:
        lines += [f"document-liveness: chance a conversation goes on (overall "
                  f"{100 * conversations['overall_continuation_probability']:.1f} %)",
                  *_liveness_class_rows(conversations["classes"])]
    return "\n".join(lines)


def _liveness_class_rows(classes: list[dict]) -> list[str]:
    """A header and one row per class of a liveness model's estimates."""
    lines = [f"{'after':>6}  {'class':<30}  {'states':>7}  {'continued':>9}  {'estimate':>8}"]
    for row in classes:
        kind, bits = row["class"]
        low, high = (0, 0) if bits == 0 else (1 << (bits - 1), (1 << bits) - 1)
        span = str(low) if low == high else f"{low}-{high}"
        after, label = (("first", f"generated {span} tokens") if kind == "first"
                        else ("later", f"prompt lengths vary by {span}"))
        lines.append(f"{after:>6}  {label:<30}  {row['states']:>7,}  {row['continued']:>9,}  "
                     f"{100 * row['estimated_p']:>7.1f}%")
    return lines


def format_sweep(result: SweepResult, block_size: int, kv_bytes_per_token: int) -> str:
    """Token hit rate per capacity, in percent (each value says so): one column per
    policy, then Belady and infinite; below the table, the working set, the widest
    lru->Belady gap and how each online policy compares with lru."""
    columns = [*result.policies, *(["belady"] if result.belady_hit_rates else []), "infinite"]
    header = ["blocks", "of working set", "GiB", *columns]
    lines = []
    for i, num_blocks in enumerate(result.capacities):
        rates = [result.policy_to_hit_rates[p][i] for p in result.policies]
        if result.belady_hit_rates:
            rates.append(result.belady_hit_rates[i])
        rates.append(result.infinite_hit_rate)
        lines.append([f"{num_blocks:,}", _share(num_blocks, result.working_set_blocks),
                      f"{capacity_gib(num_blocks, block_size, kv_bytes_per_token):.2f}",
                      *(f"{100 * r:.2f}%" for r in rates)])
    widths = [max(len(row[k]) for row in [header, *lines]) for k in range(len(header))]
    text = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
            for row in [header, *lines]]
    text.insert(1, "  ".join("-" * w for w in widths))
    text.append(f"working set: {result.working_set_blocks:,} blocks (the trace's distinct "
                f"full blocks)")
    gap = result.widest_gap()
    if gap is not None and gap["best_policy"] is not None:
        closed = gap["fraction_of_gap_closed"]
        text.append(
            f"widest LRU->Belady gap: {100 * gap['gap']:.2f} points at "
            f"{gap['capacity_blocks']:,} blocks; best online policy {gap['best_policy']} "
            f"closes {_percent(closed)} of it")
    for policy, figures in result.online_versus_lru().items():
        text.append(
            f"{policy} vs lru: closes {_percent(figures['fraction_of_widest_gap_closed'])} "
            f"of the widest gap; least margin over the sweep "
            f"{figures['min_minus_baseline_points']:+.2f} points")
    for violation in result.ordering_violations:
        text.append(f"ORDERING VIOLATION: {violation}")
    return "\n".join(text)


def _share(num_blocks: int, working_set: int) -> str:
    return f"{100 * num_blocks / working_set:.1f}%" if working_set else "n/a"


def _percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.1f} %"


def plot_formats() -> list[str]:
    """The file extensions :func:`plot_sweep` can write here: matplotlib's image formats,
    less those whose helper is missing (pgf runs a TeX system; webp and avif need a Pillow
    built with them), so a bad choice fails before a sweep rather than after it."""
    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase

    formats = list(FigureCanvasBase.get_supported_filetypes())
    if shutil.which(matplotlib.rcParams["pgf.texsystem"]) is None:
        formats.remove("pgf")
    try:
        from PIL import features
    except ImportError:  # pragma: no cover - matplotlib requires Pillow
        features = None
    for name in _PILLOW_FORMATS:
        if name in formats and (features is None or not features.check(name)):
            formats.remove(name)
    return sorted(formats)


def plot_format(path: str) -> str:
    """The format :func:`plot_sweep` writes ``path`` in: its extension's, PNG without one.
    Raises ValueError, naming the formats there are, for an extension none of them has."""
    extension = os.path.splitext(path)[1][1:].lower()
    if not extension:
        return DEFAULT_PLOT_FORMAT
    formats = plot_formats()
    if extension not in formats:
        raise ValueError(f"cannot draw a plot as {extension!r} (the format follows the "
                         f"extension): use one of {', '.join(formats)}")
    return extension


def plot_sweep(result: SweepResult, path: str, block_size: int, kv_bytes_per_token: int,
               title: str) -> None:
    """Draw the hit-rate curves to ``path`` in :func:`plot_format`'s format: capacity in
    blocks below, in GiB of KV above."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    bytes_per_block = block_size * kv_bytes_per_token
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    x = result.capacities
    for policy in result.policies:
        ax.plot(x, [100 * r for r in result.policy_to_hit_rates[policy]], marker="o",
                label=policy)
    if result.belady_hit_rates:
        ax.plot(x, [100 * r for r in result.belady_hit_rates], marker="s", linestyle="--",
                color="black", label="Belady (offline optimal)")
    ax.axhline(100 * result.infinite_hit_rate, color="gray", linestyle=":",
               label="infinite cache")
    ax.set_xlabel(f"KV cache capacity (blocks of {block_size} tokens)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    top = ax.secondary_xaxis(
        "top", functions=(lambda blocks: blocks * bytes_per_block / GIB,
                          lambda gib: gib * GIB / bytes_per_block))
    top.set_xlabel(f"KV cache capacity (GiB at {kv_bytes_per_token:,} bytes/token)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    # The format is given, not left to matplotlib: without an extension it would write
    # to path + ".png", a file nobody asked for.
    fig.savefig(path, format=plot_format(path))
    plt.close(fig)
