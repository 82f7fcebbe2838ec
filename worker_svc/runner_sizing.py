"""What the model runner reads off the model and the device to size itself: the longest
sequence, the EOS token, the bytes for the KV cache."""

from __future__ import annotations

import torch

from worker_svc.config import GiB, ModelRunnerConfig


def max_model_len(model_config, wanted: int | None) -> int:
    """`wanted` within the model's limit (its own limit when None)."""
    limit = int(getattr(model_config, "max_position_embeddings", 0) or 0) or None
    window = getattr(model_config, "sliding_window", None)
    if window and getattr(model_config, "use_sliding_window", True):
        # paged attention here attends to the whole context: stay within the window
        limit = min(limit or window, int(window))
    if wanted is None:
        if limit is None:
            raise ValueError("the model states no max_position_embeddings: set max_model_len")
        return limit
    if limit is not None and wanted > limit:
        raise ValueError(f"max_model_len={wanted} > the model's limit {limit}")
    return wanted


def eos_token_id(hf_model) -> int | None:
    gen = getattr(hf_model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = getattr(hf_model.config, "eos_token_id", None)
    if isinstance(eos, list | tuple):
        eos = eos[0] if eos else None
    return None if eos is None else int(eos)


def kv_budget(config: ModelRunnerConfig, device: torch.device) -> int:
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return GiB
