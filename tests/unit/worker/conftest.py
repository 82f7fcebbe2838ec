"""Models the worker tests share."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def llama_hd64_dir(tmp_path_factory):
    """A 2-layer random Llama with head_dim 64 (hidden 128, 2 heads / 1 KV head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("llama-hd64")
    LlamaForCausalLM(config).save_pretrained(path)
    return path
