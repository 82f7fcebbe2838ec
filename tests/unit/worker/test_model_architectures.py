"""The model implementation (worker_svc/model, CausalLM over an op table) gives transformers'
logits, token by token, for each Llama-family architecture it runs (Llama, Qwen2 with q/k/v
biases, Qwen3 with q/k norms, Mistral) on each backend (reference: torch; native: this CPU's
kernels, the decode stack included where it applies), through the paged KV cache: a whole
prefill, a prefill in chunks (each chunk reads the earlier ones from the cache), decode steps
beside prefill chunks, a prefix hit (a request starting on another's cached blocks), and the
recompute of a preempted request whose blocks were overwritten. Also: what it refuses, and
Llama 3's rope scaling."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.cpu_levels import CAPS, needs_level  # noqa: E402
from worker_svc import attention, decode_stack  # noqa: E402
from worker_svc.model import CausalLM, UnsupportedModel, spec_of  # noqa: E402
from worker_svc.ops import NativeOps, select_ops  # noqa: E402

CPU = torch.device("cpu")
ARCHS = {  # name -> (model class, config class)
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
}
KERNELS = [
    "reference",
    pytest.param("native", marks=needs_level("avx2", "the native kernels")),
]
VOCAB = 300
BLOCK = 4


def tiny_config(arch: str, **overrides):
    """2 layers, hidden 128, 4 heads / 2 KV heads of 32 (the native rotary's and the decode
    stack's head size), random weights spread wide enough for well-separated logits."""
    settings = dict(
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    settings.update(overrides)
    return getattr(transformers, ARCHS[arch][1])(**settings)


def tiny_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHS[arch][0])(tiny_config(arch, **overrides))
    return model.eval()


@pytest.fixture(scope="module", params=list(ARCHS))
def hf(request):
    model = tiny_model(request.param)
    attn = model.model.layers[0].self_attn
    if request.param == "qwen2":  # what makes each architecture itself
        assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    if request.param == "qwen3":
        assert spec_of(model).qk_norm and attn.q_norm.weight.shape == (32,)
    return model


class Paged:
    """CausalLM on `kernels` over its own paged KV cache, driven as the runner drives it: each
    step packs every scheduled token (decodes first, by context length), and every token's
    logits come back."""

    def __init__(self, hf_model, kernels: str, num_blocks: int = 64) -> None:
        self.ops = select_ops(CPU, torch.float32, kernels)
        self.model = CausalLM.from_hf(hf_model, self.ops)
        spec = self.model.spec
        shape = (num_blocks, BLOCK, spec.num_kv_heads, spec.head_dim)
        self.key_caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
        self.value_caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
        self.ops.bind_cache(self.key_caches[0], spec.num_heads, spec.num_kv_heads, spec.head_dim)
        self.stack = decode_stack.build(self.model) if isinstance(self.ops, NativeOps) else None
        self.stack_steps = 0  # the pure-decode steps the stack ran (rather than declined)
        if self.stack is not None:
            self.model.decode_step = self._counted_stack

    def _counted_stack(self, x, cos, sin, meta):
        h = self.stack(x, cos, sin, meta)
        self.stack_steps += h is not None
        return h

    def step(self, chunks: list[tuple[list[int], list[int], int, int]]) -> list[torch.Tensor]:
        """chunks: (the request's tokens, its block ids, tokens already cached, tokens this
        step); returns each chunk's logits [n, vocab], in the order given."""
        order = sorted(range(len(chunks)), key=lambda i: (chunks[i][3] != 1, chunks[i][2]))
        packed = [chunks[i] for i in order]
        c = np.array([p[2] for p in packed], dtype=np.int64)
        n = np.array([p[3] for p in packed], dtype=np.int64)
        width = max(len(p[1]) for p in packed)
        table = np.zeros((len(packed), width), dtype=np.int64)
        ids, positions, slots = [], [], []
        for row, (tokens, blocks, computed, scheduled) in enumerate(packed):
            table[row, : len(blocks)] = blocks
            for pos in range(computed, computed + scheduled):
                ids.append(tokens[pos])
                positions.append(pos)
                slots.append(blocks[pos // BLOCK] * BLOCK + pos % BLOCK)
        meta = attention.build_metadata(
            key_caches=self.key_caches,
            value_caches=self.value_caches,
            block_size=BLOCK,
            block_table=table,
            num_computed=c,
            num_scheduled=n,
            num_decodes=int((n == 1).sum()),
            decode_group_size=2,  # several decode groups: their masks over different lengths
            slot_mapping=torch.tensor(slots),
            dtype=torch.float32,
            device=CPU,
            decode_kernel=self.ops.attention_kernel,
            native_prefill=self.ops.native_prefill,
        )
        total = len(ids)
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(ids), torch.tensor(positions), torch.arange(total), meta
            )
        assert logits.shape == (total, VOCAB)
        ends = np.cumsum(n)
        out = [logits[e - k : e] for e, k in zip(ends.tolist(), n.tolist(), strict=True)]
        result: list[torch.Tensor] = [torch.empty(0)] * len(chunks)
        for slot, i in enumerate(order):
            result[i] = out[slot]
        return result


class Oracle:
    """transformers' logits of each full sequence (causal: a prefix's rows are its own)."""

    def __init__(self, hf_model) -> None:
        self.hf, self.cache = hf_model, {}

    def logits(self, tokens: list[int]) -> torch.Tensor:
        key = tuple(tokens)
        if key not in self.cache:
            with torch.no_grad():
                self.cache[key] = self.hf(torch.tensor([tokens])).logits[0].float()
        return self.cache[key]

    def check(self, got: torch.Tensor, tokens: list[int], computed: int) -> None:
        """got: the logits of tokens[computed : computed + len(got)]."""
        want = self.logits(tokens)[computed : computed + got.shape[0]]
        scale = want.abs().max().item()
        # float32: the same formulas, sums in another order (the GEMMs, attention's softmax)
        torch.testing.assert_close(got, want, atol=1e-4 * scale, rtol=1e-4)


def sequences(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(k)] for k in lengths]


def blocks_from(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // BLOCK)))


def run_stack_check(paged: Paged, arch: str) -> None:
    """Where the float32 decode stack exists at this level, it ran the pure-decode steps
    (Qwen3's q/k norms keep the layer loop)."""
    if paged.ops.name == "native" and CAPS.has("avx2") and arch != "qwen3":
        assert paged.stack is not None and paged.stack_steps > 0


@pytest.mark.parametrize("kernels", KERNELS)
def test_whole_prefill(hf, kernels):
    """Two prompts prefilled whole in one step (13 and 6 tokens, over partly filled blocks),
    and a one-token prompt beside them."""
    paged, oracle = Paged(hf, kernels), Oracle(hf)
    a, b, c = sequences(1, (13, 6, 1))
    ba, bb, bc = blocks_from(0, 13), blocks_from(10, 6), blocks_from(20, 1)
    got = paged.step([(a, ba, 0, 13), (b, bb, 0, 6), (c, bc, 0, 1)])
    for logits, tokens in zip(got, (a, b, c), strict=True):
        oracle.check(logits, tokens, 0)


@pytest.mark.parametrize("kernels", KERNELS)
def test_prefill_in_chunks(hf, kernels):
    """A 23-token prompt in chunks of 5, 5, 9 and 4 tokens (chunk edges inside blocks): each
    chunk attends to the earlier ones through the cache; another prompt's chunks beside it."""
    paged, oracle = Paged(hf, kernels), Oracle(hf)
    a, b = sequences(2, (23, 11))
    ba, bb = blocks_from(7, 23), blocks_from(40, 11)
    done = {"a": 0, "b": 0}
    for na, nb in ((5, 0), (5, 6), (9, 5), (4, 0)):
        step = [(a, ba, done["a"], na)] + ([(b, bb, done["b"], nb)] if nb else [])
        got = paged.step(step)
        oracle.check(got[0], a, done["a"])
        if nb:
            oracle.check(got[1], b, done["b"])
        done["a"] += na
        done["b"] += nb
    assert done == {"a": 23, "b": 11}


@pytest.mark.parametrize("kernels", KERNELS)
def test_decode_steps(hf, kernels, request):
    """Three requests prefilled, then decoded together for 6 steps (contexts crossing block
    edges), a fourth prompt's prefill chunk joining the decodes halfway."""
    arch = request.node.callspec.params["hf"]
    paged, oracle = Paged(hf, kernels), Oracle(hf)
    prompts = sequences(3, (9, 4, 15, 7))
    full = [p + g for p, g in zip(prompts, sequences(4, (6, 6, 6, 0)), strict=True)]
    blocks = [blocks_from(16 * i, 24) for i in range(4)]
    got = paged.step([(full[i], blocks[i], 0, len(prompts[i])) for i in range(3)])
    for i in range(3):
        oracle.check(got[i], full[i], 0)
    for k in range(6):
        step = [(full[i], blocks[i], len(prompts[i]) + k, 1) for i in range(3)]
        if k == 3:  # a prefill chunk beside the decodes
            step.append((full[3], blocks[3], 0, 7))
        got = paged.step(step)
        for i, logits in enumerate(got):
            oracle.check(logits, full[i], step[i][2])
    run_stack_check(paged, arch)


@pytest.mark.parametrize("kernels", KERNELS)
def test_prefix_hit(hf, kernels):
    """A second request whose first 8 tokens (two whole blocks) are the first's: it starts on
    the first's cached blocks and computes only its own suffix, then decodes; the first keeps
    decoding on its own blocks beside it."""
    paged, oracle = Paged(hf, kernels), Oracle(hf)
    (a,) = sequences(5, (14,))
    b = a[:8] + sequences(6, (9,))[0]
    ba = blocks_from(0, 14)
    bb = ba[:2] + blocks_from(30, 9)
    oracle.check(paged.step([(a, ba, 0, 12)])[0], a, 0)
    got = paged.step([(b, bb, 8, 7), (a, ba, 12, 1)])  # the suffix, 7 of its 9 tokens
    oracle.check(got[0], b, 8)
    oracle.check(got[1], a, 12)
    got = paged.step([(b, bb, 15, 1), (a, ba, 13, 1)])
    oracle.check(got[0], b, 15)
    oracle.check(got[1], a, 13)
    oracle.check(paged.step([(b, bb, 16, 1)])[0], b, 16)


@pytest.mark.parametrize("kernels", KERNELS)
def test_recompute_after_preemption(hf, kernels):
    """A request prefilled and decoded, preempted: another request's tokens overwrite its
    blocks; resumed on other blocks it recomputes its prompt and generated tokens (in chunks)
    and decodes on with transformers' logits."""
    paged, oracle = Paged(hf, kernels), Oracle(hf)
    a, other = sequences(7, (21, 17))
    first = blocks_from(0, 21)
    oracle.check(paged.step([(a, first, 0, 13)])[0], a, 0)
    for pos in range(13, 16):
        oracle.check(paged.step([(a, first, pos, 1)])[0], a, pos)
    # preempted: its blocks go to `other`, which fills them with its own K/V
    oracle.check(paged.step([(other, first, 0, 17)])[0], other, 0)
    resumed = blocks_from(40, 21)
    got = paged.step([(a, resumed, 0, 10), (other, first, 17 - 1, 1)])  # recompute, chunk 1
    oracle.check(got[0], a, 0)
    oracle.check(got[1], other, 16)
    oracle.check(paged.step([(a, resumed, 10, 6)])[0], a, 10)  # the rest of the 16 tokens
    for pos in range(16, 21):
        oracle.check(paged.step([(a, resumed, pos, 1)])[0], a, pos)


def test_unsupported_architecture_and_parts_say_what_differs():
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=32)
    )
    with pytest.raises(UnsupportedModel, match=r"GPT2LMHeadModel is not implemented.*Llama"):
        CausalLM.from_hf(gpt2, select_ops(CPU, torch.float32, "reference"))
    small = dict(hidden_size=64, intermediate_size=64, head_dim=16, max_position_embeddings=64)
    with pytest.raises(UnsupportedModel, match=r"hidden_act='gelu'.*SiLU"):
        spec_of(tiny_model("llama", hidden_act="gelu", **small))
    with pytest.raises(UnsupportedModel, match="mlp_bias"):
        spec_of(tiny_model("llama", mlp_bias=True, **small))
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(UnsupportedModel, match="rope type 'dynamic'"):
        spec_of(tiny_model("llama", rope_scaling=dynamic, **small))
    assert issubclass(UnsupportedModel, ValueError)


@pytest.mark.parametrize("kernels", KERNELS)
def test_llama3_rope_scaling_matches_hf(kernels):
    """Llama 3's scaled rotary frequencies (long wavelengths slowed by the factor): taken from
    the loaded model, so positions past the original context give transformers' logits."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    hf_model = tiny_model("llama", seed=3, rope_scaling=scaling)
    plain = tiny_model("llama", seed=3)
    spec = spec_of(hf_model)
    assert not torch.allclose(spec.inv_freq, spec_of(plain).inv_freq)  # the scaling is on
    paged, oracle = Paged(hf_model, kernels), Oracle(hf_model)
    (a,) = sequences(8, (60,))
    blocks = blocks_from(0, 60)
    oracle.check(paged.step([(a, blocks, 0, 40)])[0], a, 0)
    oracle.check(paged.step([(a, blocks, 40, 12)])[0], a, 40)
    for pos in range(52, 60):
        oracle.check(paged.step([(a, blocks, pos, 1)])[0], a, pos)
    # and it is not the unscaled model's (the check above would notice a wrong table)
    with torch.no_grad():
        differs = plain(torch.tensor([a])).logits[0, -1] - hf_model(torch.tensor([a])).logits[0, -1]
    assert differs.abs().max() > 1e-2
