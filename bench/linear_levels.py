"""The linear layers' GFLOP/s per kind at this CPU level: SmolLM2-135M's projections for all 30
layers (weights cold in cache, as in a real step) at decode and prefill row counts.

    python bench/linear_levels.py [--json out.json]
    SPLITSERVE_CPU_LEVEL=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        ONEDNN_MAX_CPU_ISA=AVX2 python bench/linear_levels.py     # as an AVX2-only CPU would

Kinds: torch's nn.Linear ("stock"), fast_linear's replacements that this level can build
(int8-packed: `--quantization int8`'s, weights int8 under activations of the dtype).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from worker_svc import cpu_caps, packed_gemm
from worker_svc.fast_linear import (
    Int8PackedLinear,
    NativePackedLinear,
    PackedLinear,
    TransposedLinear,
    packing_available,
)

HIDDEN, INTERMEDIATE, KV = 576, 1536, 192
LAYER_SHAPES = [
    (HIDDEN, HIDDEN),
    (HIDDEN, KV),
    (HIDDEN, KV),
    (HIDDEN, HIDDEN),
    (HIDDEN, INTERMEDIATE),
    (HIDDEN, INTERMEDIATE),
    (INTERMEDIATE, HIDDEN),
]
LAYERS = 30


def kinds(dtype: torch.dtype) -> dict:
    gemm = packed_gemm.load()
    out = {"stock": lambda lin: lin}
    if dtype == torch.float32:
        out["transposed (MKL)"] = TransposedLinear
    if packing_available(dtype):
        out["packed (oneDNN)"] = PackedLinear
    if gemm is not None:
        out[f"native-packed ({cpu_caps.capabilities().level})"] = lambda lin: NativePackedLinear(
            lin, gemm
        )
    if gemm is not None and gemm.has_int8:
        out[f"int8-packed ({cpu_caps.capabilities().level})"] = lambda lin: Int8PackedLinear(
            lin, gemm
        )
    return out


def rate(make, dtype: torch.dtype, rows: int, seconds: float) -> float:
    torch.manual_seed(0)
    layers = [
        make(nn.Linear(i, o, bias=False).to(dtype)) for _ in range(LAYERS) for i, o in LAYER_SHAPES
    ]
    xs = {i: torch.randn(rows, i).to(dtype) for i in (HIDDEN, INTERMEDIATE)}
    flops = sum(2 * rows * i * o for i, o in LAYER_SHAPES) * LAYERS

    def step() -> None:
        for layer, (i, _) in zip(layers, LAYER_SHAPES * LAYERS, strict=True):
            layer(xs[i])

    step()
    n, start = 0, time.perf_counter()
    with torch.inference_mode():
        while time.perf_counter() - start < seconds or n < 2:
            step()
            n += 1
    return flops * n / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,256,2048")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    caps = cpu_caps.capabilities()
    print(f"CPU: {caps.describe()}; torch threads {torch.get_num_threads()}")
    results = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for kind, make in kinds(dtype).items():
            row = {"dtype": name, "kind": kind}
            for rows in map(int, args.rows.split(",")):
                row[rows] = round(rate(make, dtype, rows, args.seconds), 1)
            results.append(row)
            cells = "  ".join(f"{r:>6}: {row[int(r)]:7.1f}" for r in args.rows.split(","))
            print(f"{name:9} {kind:28} GFLOP/s at rows  {cells}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": caps.describe(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
