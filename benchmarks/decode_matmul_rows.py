"""Where weight-only int4 stops paying: a whole model's projections at 1..32 rows.

Times the four projections of every layer of the default model (SmolLM2-135M: 30 layers of
qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536) as one step computes them, with
int4 group-wise weights (`_weight_int4pack_mm_for_cpu`, groups of 32), int8 per-row
weights (`_weight_int8pack_mm`) and dense bfloat16, for steps of 1, 2, 4, 8, 12, 16 and 32
tokens. All 30 layers' weights are cycled through, so, as in a real step, they come from
memory rather than from a cache holding one layer. Random weights: only the shapes and
formats matter for the time. Prints JSON: milliseconds per step for each format and row
count, and the largest row count at which int4 beats bfloat16
(`prefixcache.model.quantization.DEFAULT_MAX_QUANTIZED_TOKENS` is chosen from it).

    python benchmarks/decode_matmul_rows.py [--threads 2] [--repeats 8]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

NUM_LAYERS = 30
# (output rows, input size) of each projection, as fused by the model.
PROJECTION_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
GROUP_SIZE = 32
ROW_COUNTS = (1, 2, 4, 8, 12, 16, 32)


def make_weights() -> list[dict]:
    weights = []
    for _ in range(NUM_LAYERS):
        for rows, cols in PROJECTION_SHAPES:
            nibbles = torch.randint(0, 16, (rows, cols), dtype=torch.int32)
            weights.append({
                "cols": cols,
                "int4": torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1),
                "int4_scales_zeros": torch.rand(cols // GROUP_SIZE, rows, 2,
                                                dtype=torch.bfloat16),
                "int8": torch.randint(-128, 128, (rows, cols), dtype=torch.int8),
                "int8_scales": torch.rand(rows, dtype=torch.bfloat16),
                "bfloat16": torch.randn(rows, cols, dtype=torch.bfloat16),
            })
    return weights


def step_time_ms(weights: list[dict], fmt: str, num_rows: int, repeats: int) -> float:
    inputs = {cols: torch.randn(num_rows, cols, dtype=torch.bfloat16)
              for cols in {w["cols"] for w in weights}}

    def step() -> None:
        for w in weights:
            x = inputs[w["cols"]]
            if fmt == "int4":
                torch.ops.aten._weight_int4pack_mm_for_cpu(x, w["int4"], GROUP_SIZE,
                                                           w["int4_scales_zeros"])
            elif fmt == "int8":
                torch.ops.aten._weight_int8pack_mm(x, w["int8"], w["int8_scales"])
            else:
                torch.nn.functional.linear(x, w["bfloat16"])

    step()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8, help="steps timed; best kept")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = make_weights()
    rows = {}
    for num_rows in ROW_COUNTS:
        rows[num_rows] = {fmt: round(step_time_ms(weights, fmt, num_rows, args.repeats), 2)
                          for fmt in ("int4", "int8", "bfloat16")}
    int4_wins = [n for n, times in rows.items() if times["int4"] < times["bfloat16"]]
    print(json.dumps({
        "benchmark": "decode_matmul_rows", "threads": args.threads,
        "layers": NUM_LAYERS, "projection_shapes": PROJECTION_SHAPES,
        "ms_per_step": rows,
        "largest_rows_int4_beats_bfloat16": max(int4_wins, default=None),
        "date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg()[0],
    }, indent=2))


if __name__ == "__main__":
    main()
