"""Where weight-only int4 stops paying: a whole model's projections at 1..32 rows.

Times the four projections of every layer of the default model (SmolLM2-135M: 30 layers of
qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536) as one step computes them, with
int4 group-wise weights (`_weight_int4pack_mm_for_cpu`, groups of 32), int8 per-row
weights (`_weight_int8pack_mm`), the same two formats on this package's C++ kernels
(`int4_kernel`, `int8_kernel`: `prefixcache.kernels.quantized_gemv`, when they build) and
dense bfloat16, for steps of 1, 2, 4, 8, 12, 16 and 32 tokens; and the default model's
output head (49,152 x 576) as int8 on both kernels, the format its Q8_0 embedding gets.
All 30 layers' weights are cycled through, so, as in a real step, they come from memory
rather than from a cache holding one layer. Random weights: only the shapes and formats
matter for the time. Prints JSON: milliseconds per step for each format and row count,
and the largest row count at which int4 (on the C++ kernel when it builds) beats bfloat16
(`prefixcache.model.quantization.DEFAULT_MAX_QUANTIZED_TOKENS` is chosen from it).

    python benchmarks/decode_matmul_rows.py [--threads 2] [--repeats 8]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from prefixcache.kernels import quantized_gemv

NUM_LAYERS = 30
# (output rows, input size) of each projection, as fused by the model.
PROJECTION_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
GROUP_SIZE = 32
ROW_COUNTS = (1, 2, 4, 8, 12, 16, 32)
HEAD_SHAPE = (49152, 576)


def make_weight(rows: int, cols: int, with_kernel: bool) -> dict:
    nibbles = torch.randint(0, 16, (rows, cols), dtype=torch.int32)
    scales = torch.rand(cols // GROUP_SIZE, rows, 2, dtype=torch.bfloat16)
    int8 = torch.randint(-128, 128, (rows, cols), dtype=torch.int8)
    int8_scales = torch.rand(rows, dtype=torch.bfloat16)
    weight = {
        "rows": rows, "cols": cols,
        "int4": torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1),
        "int4_scales_zeros": scales,
        "int8": int8, "int8_scales": int8_scales,
        "bfloat16": torch.randn(rows, cols, dtype=torch.bfloat16),
    }
    if with_kernel:
        d, zero = scales.transpose(0, 1).float().unbind(-1)
        weight["int4_kernel"] = quantized_gemv.pack_int4(nibbles, d, zero - 8 * d)
        weight["int8_kernel"] = quantized_gemv.pack_int8(int8, int8_scales.float())
    return weight


def make_weights(with_kernel: bool) -> list[dict]:
    return [make_weight(rows, cols, with_kernel)
            for _ in range(NUM_LAYERS) for rows, cols in PROJECTION_SHAPES]


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
            elif fmt == "int4_kernel":
                quantized_gemv.int4_gemv(x, w["int4_kernel"], w["rows"])
            elif fmt == "int8_kernel":
                quantized_gemv.int8_gemv(x, *w["int8_kernel"], w["rows"])
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
    with_kernel = quantized_gemv.load_quantized_gemv()
    weights = make_weights(with_kernel)
    head = [make_weight(*HEAD_SHAPE, with_kernel)]
    formats = ("int4", "int8", "bfloat16")
    head_formats = ("int8",)
    if with_kernel:
        formats += ("int4_kernel", "int8_kernel")
        head_formats += ("int8_kernel",)
    rows, head_rows = {}, {}
    for num_rows in ROW_COUNTS:
        rows[num_rows] = {fmt: round(step_time_ms(weights, fmt, num_rows, args.repeats), 2)
                          for fmt in formats}
        head_rows[num_rows] = {fmt: round(step_time_ms(head, fmt, num_rows, args.repeats), 2)
                               for fmt in head_formats}
    best_int4 = "int4_kernel" if with_kernel else "int4"
    int4_wins = [n for n, times in rows.items() if times[best_int4] < times["bfloat16"]]
    print(json.dumps({
        "benchmark": "decode_matmul_rows", "threads": args.threads,
        "layers": NUM_LAYERS, "projection_shapes": PROJECTION_SHAPES,
        "kernels_built": with_kernel,
        "ms_per_step": rows,
        "head_shape": HEAD_SHAPE, "head_ms_per_step": head_rows,
        "largest_rows_int4_beats_bfloat16": max(int4_wins, default=None),
        "int4_format_compared": best_int4,
        "date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg()[0],
    }, indent=2))


if __name__ == "__main__":
    main()
