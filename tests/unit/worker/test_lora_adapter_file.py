"""Reading a PEFT adapter: what it holds (ranks, targets, PEFT's scalings), and each adapter the
worker refuses with one sentence, leaving nothing registered."""

from __future__ import annotations

import json
import math
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from tests.unit.worker.lora_adapters import make_adapter  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.lora import LoraLoadError  # noqa: E402
from worker_svc.lora.sites import MODULES  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402


def runner_for(model_dir, **options) -> ModelRunner:
    config = dict(model=str(model_dir), kernels="reference", block_size=4, num_gpu_blocks=32)
    return ModelRunner(ModelRunnerConfig(**{**config, "warmup_tokens": 0, **options}))


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    return runner_for(tiny_llama_dir, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def good(tiny_llama_dir, tmp_path_factory):
    return make_adapter(
        tiny_llama_dir,
        tmp_path_factory.mktemp("good"),
        seed=1,
        r=4,
        lora_alpha=8,
        target_modules=list(MODULES),
    )


def other_llama(tmp_path, **shape):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    config = LlamaConfig(
        **{**config, **shape}, num_attention_heads=4, num_key_value_heads=2, vocab_size=512
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def refused(runner, path, words: str, name: str = "bad") -> None:
    with pytest.raises(LoraLoadError, match=words) as info:
        runner.load_lora(name, str(path))
    message = str(info.value)
    assert "\n" not in message and name in message
    assert name not in [a.name for a in runner.lora_adapters()]


def test_reads_ranks_targets_and_scalings(tiny_llama_dir, tmp_path):
    from worker_svc.lora.adapter_file import BaseShapes, read_adapter

    path = make_adapter(
        tiny_llama_dir,
        tmp_path / "a",
        seed=2,
        r=4,
        lora_alpha=6,
        target_modules=["q_proj", "v_proj", "up_proj"],
        rank_pattern={"v_proj": 8},
        alpha_pattern={"layers.1.self_attn.q_proj": 2},
    )
    base = BaseShapes(2, {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64),
                          "o_proj": (64, 64), "gate_proj": (128, 64), "up_proj": (128, 64),
                          "down_proj": (64, 128)})  # fmt: skip
    weights = read_adapter("a", str(path), base, max_rank=8)
    assert weights.info.rank == 8 and weights.info.target_modules == ("q_proj", "v_proj", "up_proj")
    qkv = [layer["qkv"] for layer in weights.layers]
    assert qkv[0].rank.tolist() == [4, 0, 8] and qkv[0].scale.tolist() == [6 / 4, 0, 6 / 8]
    assert qkv[1].scale.tolist() == [2 / 4, 0, 6 / 8]  # alpha_pattern names layer 1's q_proj
    assert set(weights.layers[0]) == {"qkv", "gate_up"}  # no o_proj or down_proj delta
    assert weights.layers[0]["gate_up"].rank.tolist() == [0, 4]
    rs = make_adapter(
        tiny_llama_dir,
        tmp_path / "rs",
        seed=3,
        r=4,
        lora_alpha=6,
        use_rslora=True,
        target_modules=["o_proj"],
    )
    o = read_adapter("rs", str(rs), base, max_rank=8).layers[0]["o"]
    assert o.scale.tolist() == [pytest.approx(6 / math.sqrt(4))]


def test_loads_once_per_name(runner, good, tmp_path):
    info = runner.load_lora("good", str(good))
    assert (info.name, info.rank, info.target_modules) == ("good", 4, MODULES)
    assert runner.load_lora("good", str(good)) == info  # again from its path: a no-op
    copy = shutil.copytree(good, tmp_path / "copy")
    with pytest.raises(LoraLoadError, match=f"'good' is already loaded from {good}$"):
        runner.load_lora("good", str(copy))
    assert [a.name for a in runner.lora_adapters()] == ["good"]
    assert runner.unload_lora("good") and not runner.unload_lora("good")
    runner.execute_model(_empty_step())  # no request holds it: forgotten
    assert runner.lora_adapters() == []


def _empty_step():
    from common.messages import SchedulerOutput

    return SchedulerOutput()


def test_missing_files(runner, good, tmp_path):
    refused(runner, tmp_path / "nowhere", "no such directory")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        partial = shutil.copytree(good, tmp_path / f"without-{name}")
        (partial / name).unlink()
        refused(runner, partial, f"no {name}")


def test_corrupt_files(runner, good, tmp_path):
    corrupt = shutil.copytree(good, tmp_path / "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    refused(runner, corrupt, "adapter_model.safetensors is not readable")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    refused(runner, corrupt, "adapter_model.safetensors is not readable")
    bad_json = shutil.copytree(good, tmp_path / "bad-json")
    (bad_json / "adapter_config.json").write_text("{not json")
    refused(runner, bad_json, "not readable JSON")


@pytest.mark.parametrize(
    "option, value, words",
    [
        ("use_dora", True, "DoRA"),
        ("fan_in_fan_out", True, "fan_in_fan_out"),
        ("bias", "all", "bias='all'"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("peft_type", "IA3", "not a PEFT LoRA config"),
        ("target_modules", ["q_proj", "embed_tokens"], r"\['embed_tokens'\] are not among"),
    ],
)
def test_unsupported_options(runner, good, tmp_path, option, value, words):
    edited = shutil.copytree(good, tmp_path / "edited")
    config = json.loads((edited / "adapter_config.json").read_text())
    config[option] = value
    (edited / "adapter_config.json").write_text(json.dumps(config))
    refused(runner, edited, words)


def test_a_module_outside_the_seven(runner, tiny_llama_dir, tmp_path):
    path = make_adapter(
        tiny_llama_dir,
        tmp_path / "head",
        seed=4,
        r=4,
        lora_alpha=8,
        target_modules=r"(.*\.q_proj|lm_head)",  # a regex: only the weights tell
    )
    refused(runner, path, r"lm_head\S* is not a LoRA weight of q_proj")


def test_rank_above_max_lora_rank(runner, tiny_llama_dir, tmp_path):
    path = make_adapter(
        tiny_llama_dir, tmp_path / "r16", seed=5, r=16, lora_alpha=8, target_modules=["q_proj"]
    )
    refused(runner, path, "rank 16 > max_lora_rank 8")


def test_another_base_model(runner, tmp_path):
    wider = make_adapter(
        other_llama(tmp_path / "wide", hidden_size=96),
        tmp_path / "wide-lora",
        seed=6,
        r=4,
        lora_alpha=8,
        target_modules=["k_proj"],
    )
    refused(runner, wider, "do not fit this model's 32x64 projection")
    deeper = make_adapter(
        other_llama(tmp_path / "deep", num_hidden_layers=3),
        tmp_path / "deep-lora",
        seed=7,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
    )
    refused(runner, deeper, "layer 2 is past this model's 2")


def test_lora_off_refuses_loads(tiny_llama_dir, good):
    off = runner_for(tiny_llama_dir)
    refused(off, good, r"LoRA is off on this worker \(max_loras=0\)")


def test_lora_modules_load_at_start(tiny_llama_dir, good, tmp_path):
    started = runner_for(tiny_llama_dir, max_loras=1, lora_modules=f"g={good}")
    assert [a.name for a in started.lora_adapters()] == ["g"]
    with pytest.raises(LoraLoadError, match="no such directory"):
        runner_for(tiny_llama_dir, max_loras=1, lora_modules=f"g={tmp_path / 'missing'}")
