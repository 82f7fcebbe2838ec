"""--quantization int8: per-channel int8 weights, the packed GEMM over them, the runner with them,
and the refusal where they cannot run."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from common.messages import NewRequestData, SamplingParams, SchedulerOutput  # noqa: E402
from splitserve.inprocess import generate_in_process  # noqa: E402
from tests.cpu_levels import needs_level  # noqa: E402
from worker_svc import amx_gemm, cpu_caps, packed_gemm, quantization  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402
from worker_svc.ops import NativeOps, native_linear  # noqa: E402
from worker_svc.ops.native_linear import Int8PackedLinear  # noqa: E402

GEMM = packed_gemm.load()
needs_gemm = needs_level("avx2", "the packed GEMM's int8 entry")
EPS32 = 2.0**-24  # float32's unit roundoff


def int8_linear(lin: nn.Linear) -> Int8PackedLinear:
    """The native backend's int8 linear over lin's weights."""
    bias = None if lin.bias is None else lin.bias.detach()
    return Int8PackedLinear(lin.weight.detach(), bias, GEMM)


def test_quantize_int8_is_symmetric_per_output_channel():
    torch.manual_seed(0)
    weight = torch.randn(6, 50)
    weight[3] = 0.0
    q, scale = quantization.quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (6,)
    assert torch.equal(scale, weight.abs().amax(dim=1) / 127)
    assert q.abs().max() == 127 and q.min() >= -127  # each row's largest weight is +-127
    assert scale[3] == 0 and not q[3].any()
    # round to nearest: every weight is within half a step of its row
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()


def int8_bound(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """|int8 output - float32 output| per element: each weight moved by at most scale / 2, so
    scale / 2 * sum |x|; plus both sides' float32 summation error (K u sum |x| |w|, w's
    magnitude at most |w| + scale / 2)."""
    _, scale = quantization.quantize_int8(lin.weight)
    x, w, half = x.double().abs(), lin.weight.double().abs(), scale.double() / 2
    k = lin.in_features
    return half * x.sum(-1, keepdim=True) + 2 * (k + 2) * EPS32 * (x @ (w + half[:, None]).T)


@needs_gemm
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "in_features,out_features", [(96, 40), (576, 192), (7, 100), (1536, 576), (33, 49)]
)
def test_int8_linear_is_within_the_quantization_bound_of_float32(bias, in_features, out_features):
    """Panel tails, odd K, every tile size and row blocks past 192; and it is the product with
    the quantized weight (to float32 summation error), not the float32 one."""
    torch.manual_seed(in_features + out_features)
    lin = nn.Linear(in_features, out_features, bias=bias)
    int8 = int8_linear(lin)
    assert int8.packed_weight.dtype == torch.int8
    q, scale = quantization.quantize_int8(lin.weight)
    dequantized = q.double() * scale.double()[:, None]
    for rows in (1, 5, 8, 9, 64, 193):
        x = torch.randn(1, rows, in_features)
        got = int8(x)
        assert got.shape == (1, rows, out_features) and got.dtype == torch.float32
        assert ((got.double() - lin(x).double()).abs() <= int8_bound(x, lin)).all(), rows
        bias64 = None if lin.bias is None else lin.bias.double()
        exact = nn.functional.linear(x.double(), dequantized, bias64)
        slack = (in_features + 2) * EPS32 * (x.double().abs() @ dequantized.abs().T) + 1e-30
        assert ((got.double() - exact).abs() <= slack + EPS32 * exact.abs()).all(), rows


@needs_gemm
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_in_bfloat16_is_float32_math_rounded_once(bias):
    """A bfloat16 model: bfloat16 rows and bias, int8 weights, float32 sums rounded once."""
    torch.manual_seed(5)
    lin = nn.Linear(576, 200, bias=bias).to(torch.bfloat16)
    int8 = int8_linear(lin)
    q, scale = quantization.quantize_int8(lin.weight)
    dequantized = q.double() * scale.double()[:, None]
    for rows in (1, 9, 193):
        x = torch.randn(rows, 576).to(torch.bfloat16)
        got = int8(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
        bias64 = None if lin.bias is None else lin.bias.double()
        exact = nn.functional.linear(x.double(), dequantized, bias64)
        bound = exact.abs() * 2.0**-8 + 580 * EPS32 * (x.double().abs() @ dequantized.abs().T)
        assert ((got.double() - exact).abs() <= bound).all(), rows


@needs_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_batch_invariant(dtype):
    """A row's output is one fixed FMA chain: the same bits whatever it is batched with."""
    torch.manual_seed(1)
    int8 = int8_linear(nn.Linear(576, 1536).to(dtype))
    x = torch.randn(300, 576).to(dtype)
    full = int8(x)
    for start, stop in ((0, 1), (7, 8), (100, 164), (190, 300)):
        assert torch.equal(int8(x[start:stop]), full[start:stop])
    assert torch.equal(int8(x.t().contiguous().t()), full)  # a strided view is copied first


@needs_gemm
def test_int8_linear_threads_do_not_change_the_result():
    torch.manual_seed(2)
    int8 = int8_linear(nn.Linear(576, 49152 // 8))
    x = torch.randn(64, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int8(x)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(int8(x), one)
    finally:
        torch.set_num_threads(before)


@needs_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_ops_int8_make_every_linear_int8(dtype):
    """--quantization int8: every linear the native backend makes (q/k/v, the gated product's
    gate and up, o, down, lm_head) holds int8 weights, and keeps the model's dtype."""
    ops = NativeOps(dtype, "int8")
    assert ops.linear_kind == "int8-packed"
    w = torch.randn(96, 8).to(dtype)
    apart = ops.qkv([w[:8], w[:4], w[:4]], [None] * 3)  # not whole 48-column panels
    joined = ops.qkv([w, w[:48], w[:48]], [None] * 3)  # one GEMM over the three
    gated = ops.gated_product(w, w)
    linears = [ops.linear(w), *apart.linears, joined.linear, gated.gate, gated.up]
    assert all(type(x) is Int8PackedLinear for x in linears)
    assert all(x.packed_weight.dtype == torch.int8 for x in linears)
    assert ops.linear(w)(torch.randn(3, 8).to(dtype)).dtype == dtype


@needs_gemm
def test_int8_and_bfloat16_take_the_packed_gemm_without_amx(monkeypatch):
    """A CPU without AMX (or AVX-512): bfloat16 and int8 layers both run the packed GEMM and
    never ask oneDNN's bfloat16 packing or the AMX kernel."""
    monkeypatch.setattr(
        "worker_svc.cpu_caps._probed", cpu_caps.CpuCapabilities("amx", "avx2", frozenset())
    )
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", _refuse, raising=False)
    assert amx_gemm.load() is None
    torch.manual_seed(4)
    x = torch.randn(5, 64).to(torch.bfloat16)
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    want = lin(x)
    for method, kind in (("none", "native-packed"), ("int8", "int8-packed")):
        assert native_linear.linear_kind(torch.bfloat16, method) == kind
        linear = native_linear.make_linear(kind, lin.weight.detach(), lin.bias.detach())
        assert linear.kind == kind
        got = linear(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


def _refuse(*args, **kwargs):
    raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl")


def test_int8_is_refused_on_cuda_and_float16_with_a_sentence():
    cpu = torch.device("cpu")
    quantization.check_supported("none", torch.device("cuda"), torch.float16)  # nothing asked
    with pytest.raises(quantization.Unsupported, match=r"CPU only .* --quantization none\.$"):
        quantization.check_supported("int8", torch.device("cuda:0"), torch.bfloat16)
    with pytest.raises(quantization.Unsupported, match=r"not torch.float16: .*bfloat16\.$"):
        quantization.check_supported("int8", cpu, torch.float16)
    with pytest.raises(ValueError, match="unknown quantization"):
        ModelRunnerConfig(quantization="int4")


def test_runner_refuses_int8_without_the_native_gemm_before_loading(monkeypatch):
    """No packed GEMM (a CPU below avx2 or a missing library), or --kernels reference: the runner
    refuses before it looks for the model (a path that does not exist is never reached), and
    the worker's main says why and exits instead of raising."""
    from worker_svc import main as worker_main
    from worker_svc.link import WorkerLinkConfig

    reference = ModelRunnerConfig(model="/no/such/model", quantization="int8", kernels="reference")
    with pytest.raises(quantization.Unsupported, match="--kernels reference keeps to torch's"):
        ModelRunner(reference)
    monkeypatch.setattr(packed_gemm, "load", lambda: None)
    config = ModelRunnerConfig(model="/no/such/model", quantization="int8")
    with pytest.raises(quantization.Unsupported, match="needs the native packed GEMM"):
        ModelRunner(config)
    logged = []
    monkeypatch.setattr(worker_main.log, "error", lambda event, **kw: logged.append(kw))
    assert worker_main.main(WorkerLinkConfig(worker_id="w"), config) == 2
    assert "--quantization int8 needs the native packed GEMM" in logged[0]["reason"]


PROMPTS = ([5, 9, 33, 7, 100, 250, 12], [300, 301], list(range(40, 90)))
MAX_TOKENS = 8
LOGPROB_TOLERANCE = 0.25


def next_token_logprobs(runner: ModelRunner, sequences: list[list[int]]) -> list[dict]:
    """One step with every sequence as a new request: each one's top-20 {token: logprob}."""
    runner.reset()
    params = SamplingParams(temperature=0.0, logprobs=20)
    new, start = [], 0
    for i, seq in enumerate(sequences):
        blocks = -(-(len(seq) + 1) // runner.block_size)
        new.append(
            NewRequestData(f"s{i}", list(seq), params, list(range(start, start + blocks)), 0)
        )
        start += blocks
    scheduled = {r.request_id: len(r.prompt_token_ids) for r in new}
    out = runner.execute_model(SchedulerOutput(new_requests=new, num_scheduled_tokens=scheduled))
    return [dict(out.logprobs[f"s{i}"][0].top) for i in range(len(sequences))]


@needs_gemm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_int8_tokens_and_logprobs_stay_close_to_unquantized(tiny_llama_dir, dtype):
    """Along the unquantized greedy continuation of each prompt, int8 moves the chosen token's
    logprob by less than LOGPROB_TOLERANCE and picks the same token wherever the unquantized
    top two are further apart than twice that. Why 0.25: each weight moves by at most 1/254 of
    its row's largest (about 2.5 standard deviations in these 64- and 128-wide Gaussian rows),
    a uniform error of about 0.6% of a weight's size, in each of a pass's 15 products; the
    tiny Llama's logits (standard deviation 1.6) then move by some 0.04 each, and the largest
    of the 24 positions' logprob changes, a difference of two logits, stays under 0.25
    (measured: 0.11; bfloat16 weights alone: 0.03). The random model has near ties (top two
    0.001 apart), so token equality is asked only where the gap leaves room."""

    def runner(method: str) -> ModelRunner:
        config = ModelRunnerConfig(
            model=str(tiny_llama_dir),
            dtype=dtype,
            quantization=method,
            block_size=4,
            num_gpu_blocks=256,
            num_threads=2,
        )
        return ModelRunner(config)

    plain, int8 = runner("none"), runner("int8")
    assert int8.linear_kind == "int8-packed" and "linear=int8-packed" in int8.kernels
    greedy = generate_in_process(list(PROMPTS), max_tokens=MAX_TOKENS, runner=plain)
    assert all(len(t) == 4 for t in generate_in_process(list(PROMPTS), 4, runner=int8))
    prefixes = [p + t[:i] for p, t in zip(PROMPTS, greedy, strict=True) for i in range(MAX_TOKENS)]
    want, got = next_token_logprobs(plain, prefixes), next_token_logprobs(int8, prefixes)
    for before, after in zip(want, got, strict=True):
        (token, best), second = sorted(before.items(), key=lambda kv: -kv[1])[:2]
        assert abs(after[token] - best) < LOGPROB_TOLERANCE
        if best - second[1] > 2 * LOGPROB_TOLERANCE:
            assert max(after, key=after.get) == token


@pytest.fixture(scope="module")
def llama_hd32_dir(tmp_path_factory):
    """A 2-layer random Llama with head_dim 32, which the native rotary and decode stack take."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=300,
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    path = tmp_path_factory.mktemp("llama-hd32")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@needs_level("avx2", "the float32 decode stack")
def test_int8_decode_steps_run_the_native_stack_with_the_loops_bits(llama_hd32_dir):
    from tests.unit.worker.test_decode_stack import counted, stack_vs_loop

    config = ModelRunnerConfig(
        model=str(llama_hd32_dir), quantization="int8", block_size=4, num_gpu_blocks=256
    )
    runner = ModelRunner(config)
    assert runner.forward_path == "model+decode-stack"
    counted(runner.model.decode_step)
    prompts = [[(i * 7 + j * 3) % 290 + 3 for j in range(2 + i % 9)] for i in range(21)]
    got, want, used = stack_vs_loop(runner, prompts, chunk=8, decodes=4)
    assert used == 3 and len(got) == 5  # the pure-decode steps; the two prefill ones not
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
