"""The linear layers' GFLOP/s per kind at this CPU level: SmolLM2-135M's projections for all 30
layers (weights cold in cache, as in a real step) at decode and prefill row counts.

    python bench/linear_levels.py [--json out.json]
    SPLITSERVE_CPU_LEVEL=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        ONEDNN_MAX_CPU_ISA=AVX2 python bench/linear_levels.py     # as an AVX2-only CPU would

Kinds: torch's F.linear ("torch", the reference backend's), and the native backend's linear
kinds (worker_svc/ops/native_linear.py) that this level can build (int8-packed:
`--quantization int8`'s, weights int8 under activations of the dtype).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from worker_svc import amx_gemm, cpu_caps, packed_gemm
from worker_svc.ops import native_linear

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


def kinds(dtype: torch.dtype) -> dict[str, str]:
    """Label -> native_linear kind, for the kinds this level builds for `dtype`."""
    gemm, level = packed_gemm.load(), cpu_caps.capabilities().level
    out = {"torch (F.linear)": "torch"}
    if dtype == torch.float32:
        out["transposed (MKL)"] = "transposed"
    if native_linear.onednn_packing_available(dtype):
        out["onednn-packed"] = "onednn-packed"
    if dtype == torch.bfloat16 and amx_gemm.load() is not None:
        out["amx-packed"] = "amx-packed"
    if gemm is not None and dtype in packed_gemm.DTYPES:
        out[f"native-packed ({level})"] = "native-packed"
    if gemm is not None and gemm.has_int8:
        out[f"int8-packed ({level})"] = "int8-packed"
    return out


def rate(kind: str, dtype: torch.dtype, rows: int, seconds: float) -> float:
    torch.manual_seed(0)
    layers = [
        native_linear.make_linear(kind, torch.randn(o, i).div_(i**0.5).to(dtype), None)
        for _ in range(LAYERS)
        for i, o in LAYER_SHAPES
    ]
    xs = {i: torch.randn(rows, i).to(dtype) for i in (HIDDEN, INTERMEDIATE)}
    flops = sum(2 * rows * i * o for i, o in LAYER_SHAPES) * LAYERS

    def step() -> None:
        for layer, (i, _) in zip(layers, LAYER_SHAPES * LAYERS, strict=True):
            layer(xs[i])

    with torch.inference_mode():
        step()
        n, start = 0, time.perf_counter()
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
        for label, kind in kinds(dtype).items():
            row = {"dtype": name, "kind": label}
            for rows in map(int, args.rows.split(",")):
                row[rows] = round(rate(kind, dtype, rows, args.seconds), 1)
            results.append(row)
            cells = "  ".join(f"{r:>6}: {row[int(r)]:7.1f}" for r in args.rows.split(","))
            print(f"{name:9} {label:28} GFLOP/s at rows  {cells}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": caps.describe(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
