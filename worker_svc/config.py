"""Configuration of the model runner (the worker's core): model, placement, KV cache, limits.

Field metadata `help` / `choices` feed the CLI flags and SPLITSERVE_* variables (common.settings);
each group's heading lists them in `splitserve worker --help` (common/config_groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config_groups import LIMITS, MODEL, ModelSource, config_group, opt

GiB = 1 << 30


@config_group(MODEL)
class ModelOptions:
    dtype: str = opt(
        "auto",
        "weights and KV cache dtype; auto: float32 on CPU, bfloat16 on CUDA",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    quantization: str = opt(
        "none",
        "weights: none (the model's dtype) or int8 (weight-only, one float32 scale per output "
        "channel; activations keep the dtype; every linear layer, lm_head included); int8 "
        "runs on the CPU's native packed GEMM (avx2 level and up), elsewhere the worker refuses "
        "to start",
        choices=("none", "int8"),
    )
    seed: int = opt(0, "seed of the generator for requests without their own seed")


@config_group("KV cache")
class KvCacheOptions:
    block_size: int = opt(16, "tokens per KV cache block")
    num_gpu_blocks: int | None = opt(None, "device KV blocks (overrides kv_cache_memory)")
    kv_cache_memory: int | None = opt(
        None, "bytes for the device KV cache; default 1 GiB on CPU, half the free CUDA memory"
    )
    num_host_blocks: int = opt(0, "host KV blocks for swapped-out requests (overrides swap_space)")
    swap_space: int = opt(0, "bytes of host memory for swapped-out KV blocks")


@config_group(LIMITS)
class WorkerCapacity:
    """What this worker can hold; reported in its Register, where the scheduler takes the
    smaller of each and its own flag of the same name (scheduler_svc/engine/worker_limits.py)."""

    max_model_len: int | None = opt(
        None,
        "longest sequence; default the model's own limit. The scheduler holds this worker to "
        "the smaller of this and its own --max-model-len",
    )
    max_num_seqs: int = opt(
        256,
        "most requests in one step (rows of the persistent batch, the largest CUDA-graph "
        "batch); the scheduler runs at most the smaller of this and its own --max-num-seqs here",
    )
    max_num_batched_tokens: int = opt(
        8192,
        "most tokens in one forward pass; the scheduler's step budget for this worker is the "
        "smaller of this and its own --max-num-batched-tokens",
    )
    max_logprobs: int = opt(20, "most top-n logprobs a request may ask for")


@config_group("device and kernels")
class DeviceOptions:
    device: str = opt("auto", "auto (cuda when available), cpu, cuda, cuda:N")
    num_threads: int | None = opt(None, "torch CPU threads; default torch's choice")
    decode_group_size: int = opt(8, "decode rows per attention call, by context length")
    kernels: str = opt(
        "native",
        "native: the kernels this CPU level runs (splitserve worker --print-capabilities); "
        "reference: torch's own ops only, on any device",
        choices=("reference", "native"),
    )
    cuda_graphs: bool = opt(
        True,
        "CUDA: pure-decode steps replay a graph captured per batch and context bucket "
        "(worker_svc/cuda_graphs.py); off: every step launches its kernels one by one",
    )
    keep_freed_memory: bool = opt(
        True,
        "CPU: glibc malloc keeps freed activations for reuse instead of returning them to "
        "the kernel (each prefill step otherwise page-faults its tensors in again)",
    )
    warmup_tokens: int = opt(
        2048,
        "the worker's start: one throwaway prefill of this many tokens (at most the step and "
        "model limits; 0: none), so the largest step's activations are mapped and its kernels "
        "set up before the first request (2048: the scheduler's default step budget)",
    )


@config_group("LoRA")
class LoraOptions:
    """Multi-LoRA serving (worker_svc/lora): PEFT adapters, each request running its own or none."""

    max_loras: int = opt(
        0,
        "LoRA adapters held on the device at once (the most one step may use); 0: LoRA off, "
        "and a request naming an adapter is an error",
    )
    max_lora_rank: int = opt(16, "largest adapter rank accepted (the slots are this wide)")
    max_cpu_loras: int | None = opt(
        None,
        "adapters kept in host memory (least recently used dropped, then read from disk again "
        "when needed); default and least: max_loras",
    )
    lora_modules: str = opt(
        "",
        "adapters loaded at start: comma-separated NAME=PATH pairs, each a PEFT LoRA directory "
        "(adapter_config.json + adapter_model.safetensors)",
    )

    def lora_module_pairs(self) -> list[tuple[str, str]]:
        """lora_modules as (name, path) pairs; ValueError where one is malformed."""
        pairs = []
        for item in filter(None, (i.strip() for i in self.lora_modules.split(","))):
            name, sep, path = (part.strip() for part in item.partition("="))
            if not sep or not name or not path:
                raise ValueError(f"lora_modules item {item!r} is not NAME=PATH")
            pairs.append((name, path))
        names = [name for name, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {self.lora_modules!r}")
        return pairs


@dataclass(slots=True)
class ModelRunnerConfig(
    ModelSource, ModelOptions, KvCacheOptions, WorkerCapacity, DeviceOptions, LoraOptions
):
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
        if self.max_loras < 0 or self.max_lora_rank <= 0:
            raise ValueError("max_loras must not be negative and max_lora_rank must be positive")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras}"
            )
        if self.lora_module_pairs() and not self.max_loras:
            raise ValueError("lora_modules needs max_loras > 0 (LoRA is off at 0)")
