"""Configuration of the model runner (the worker's core): model, placement, KV cache, limits.

Field metadata `help` / `choices` feed the CLI flags and SPLITSERVE_* variables (common.settings).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1 << 30


def _opt(default, help: str, **meta):  # noqa: A002 - mirrors argparse's keyword
    return field(default=default, metadata={"help": help, **meta})


@dataclass(slots=True)
class ModelRunnerConfig:
    model: str | None = _opt(
        None, "local HF directory, .gguf file, or empty for SmolLM2-135M-Instruct"
    )
    dtype: str = _opt(
        "auto",
        "weights and KV cache dtype; auto: float32 on CPU, bfloat16 on CUDA",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = _opt("auto", "auto (cuda when available), cpu, cuda, cuda:N")
    block_size: int = _opt(16, "tokens per KV cache block")
    num_gpu_blocks: int | None = _opt(None, "device KV blocks (overrides kv_cache_memory)")
    kv_cache_memory: int | None = _opt(
        None, "bytes for the device KV cache; default 1 GiB on CPU, half the free CUDA memory"
    )
    num_host_blocks: int = _opt(0, "host KV blocks for swapped-out requests (overrides swap_space)")
    swap_space: int = _opt(0, "bytes of host memory for swapped-out KV blocks")
    max_model_len: int | None = _opt(None, "longest sequence; default the model's own limit")
    max_num_seqs: int = _opt(256, "most requests in one step (rows of the persistent batch)")
    max_num_batched_tokens: int = _opt(8192, "most tokens in one forward pass")
    seed: int = _opt(0, "seed of the generator for requests without their own seed")
    num_threads: int | None = _opt(None, "torch CPU threads; default torch's choice")
    decode_group_size: int = _opt(8, "decode rows per attention call, by context length")
    kernels: str = _opt(
        "native",
        "native: the kernels this CPU level runs (splitserve worker --print-capabilities); "
        "reference: torch's own ops only, on any device",
        choices=("reference", "native"),
    )
    quantization: str = _opt(
        "none",
        "weights: none (the model's dtype) or int8 (weight-only, one float32 scale per output "
        "channel; activations keep the dtype; every linear layer, lm_head included); int8 "
        "runs on the CPU's native packed GEMM (avx2 level and up), elsewhere the worker refuses "
        "to start",
        choices=("none", "int8"),
    )
    cuda_graphs: bool = _opt(
        True,
        "CUDA: pure-decode steps replay a graph captured per batch and context bucket "
        "(worker_svc/cuda_graphs.py); off: every step launches its kernels one by one",
    )
    keep_freed_memory: bool = _opt(
        True,
        "CPU: glibc malloc keeps freed activations for reuse instead of returning them to "
        "the kernel (each prefill step otherwise page-faults its tensors in again)",
    )
    max_logprobs: int = _opt(20, "most top-n logprobs a request may ask for")
    warmup_tokens: int = _opt(
        2048,
        "the worker's start: one throwaway prefill of this many tokens (at most the step and "
        "model limits; 0: none), so the largest step's activations are mapped and its kernels "
        "set up before the first request (2048: the scheduler's default step budget)",
    )

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "decode_group_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {self.num_gpu_blocks}")
        if self.num_host_blocks < 0 or self.swap_space < 0 or self.warmup_tokens < 0:
            raise ValueError("num_host_blocks, swap_space and warmup_tokens must not be negative")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.kernels not in ("reference", "native"):
            raise ValueError(f"unknown kernels {self.kernels!r}")
        if self.quantization not in ("none", "int8"):
            raise ValueError(f"unknown quantization {self.quantization!r}")
