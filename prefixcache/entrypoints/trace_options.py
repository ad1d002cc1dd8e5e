"""The option every command that reads traces shares: how many tokens a Mooncake-format
line's hash id names."""

from __future__ import annotations

import argparse

from prefixcache.arg_types import positive_int


def add_trace_block_size(parser: argparse.ArgumentParser) -> None:
    """``--trace-block-size N`` (``args.trace_block_size``, default 512)."""
    from prefixcache.sim.trace import MOONCAKE_BLOCK_SIZE  # the CLI imports sim lazily

    parser.add_argument(
        "--trace-block-size", type=positive_int, default=MOONCAKE_BLOCK_SIZE, metavar="N",
        help="tokens per hash id in Mooncake-format lines (default %(default)s, Mooncake's "
             "own; tools that write the format for another KV block size, such as "
             "NVIDIA's trace synthesizer, name it); Bailian lines are always 16")
