"""Weight-only int8 quantization (`--quantization int8`): symmetric, one scale per output channel.

    scale[n] = max_k |W[n, k]| / 127        W_q[n, k] = round(W[n, k] / scale[n])   (int8)

Each weight is then off by at most scale[n] / 2, so an output of the layer is within
scale[n] / 2 * sum_k |x[k]| of the unquantized product (the bound the tests check). The weights
take a quarter of float32's bytes (half of bfloat16's); the activations keep the model's dtype.
The packed GEMM (csrc/packed_gemm.c) keeps W_q in its panel layout, widens each int8 weight to
float32 in its inner loop, sums in float32 and applies scale[n] once per output, before the bias.

It runs where that GEMM runs: the CPU at the avx2 level and up with the native library, for
float32 or bfloat16 models, under `--kernels native`. Elsewhere the runner refuses it at start
(`Unsupported`, one sentence), before loading the model.
"""

from __future__ import annotations

import torch

from worker_svc import cpu_caps, packed_gemm

METHODS = ("none", "int8")


class Unsupported(ValueError):
    """A quantization this worker cannot run; the message says why, in one sentence."""


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 [out, in], float32 scales [out]); a row of zeros gets scale 0."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    return q.clamp_(-127, 127).to(torch.int8), scale


def check_supported(
    method: str, device: torch.device, dtype: torch.dtype, kernels: str = "native"
) -> None:
    """Raise Unsupported where `method` cannot run on this worker (ValueError if unknown)."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; one of {', '.join(METHODS)}")
    if method == "none":
        return
    if kernels == "reference":
        raise Unsupported(
            f"--quantization {method} runs on the native packed GEMM, and --kernels reference "
            f"keeps to torch's own ops: start the worker with --kernels native or "
            f"--quantization none."
        )
    if device.type != "cpu":
        raise Unsupported(
            f"--quantization {method} runs on the CPU only (its kernel is the native packed "
            f"GEMM), and this worker's device is {device}: start it with --quantization none."
        )
    if dtype not in packed_gemm.DTYPES:
        raise Unsupported(
            f"--quantization {method} keeps float32 or bfloat16 activations, not {dtype}: "
            f"start the worker with --dtype float32 or bfloat16."
        )
    gemm = packed_gemm.load()
    if gemm is None or not gemm.has_int8:
        raise Unsupported(
            f"--quantization {method} needs the native packed GEMM (the avx2 CPU level or "
            f"above, and a C compiler or a prebuilt kernel library), "
            f"which this worker ({cpu_caps.capabilities().describe()}) does not have: start it "
            f"with --quantization none."
        )
