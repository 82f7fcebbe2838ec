"""Greedy tokens from the ModelRunner equal Hugging Face `generate(do_sample=False)`.

Whatever the scheduling: alone, batched, chunked prefill beside decodes, prefix-cache hits,
preemption by recompute, swap-out/swap-in. `Driver` plays the scheduler with hand-built
SchedulerOutput diffs (blocks, chunks, decodes), independent of the scheduler core.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from common.messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


@dataclass
class Req:
    req_id: str
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    new_blocks: list[int] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False
    resumed: bool = False
    running: bool = True
    done: bool = False


class Driver:
    """A minimal scheduler: allocates blocks as requests grow, chunks prefills, decodes."""

    def __init__(self, runner: ModelRunner, chunk: int | None = None) -> None:
        runner.reset()
        self.runner, self.bs, self.chunk = runner, runner.block_size, chunk
        self.free = list(range(runner.num_blocks))[::-1]  # pop() -> lowest; freed reused first
        self.host_free = list(range(runner.num_host_blocks))[::-1]
        self.refs: dict[int, int] = {}
        self.reqs: dict[str, Req] = {}
        self.finished: set[str] = set()
        self.preempted: set[str] = set()
        self.swap_out_pairs: list[tuple[int, int]] = []
        self.swap_in_pairs: list[tuple[int, int]] = []

    def add(self, req_id, prompt, max_tokens, params=GREEDY, share_from=None, num_cached=0):
        r = Req(req_id, list(prompt), max_tokens, params)
        if share_from is not None:  # prefix-cache hit on full blocks of an earlier request
            assert (
                num_cached % self.bs == 0
                and prompt[:num_cached] == (self.reqs[share_from].prompt[:num_cached])
            )
            r.blocks = self.reqs[share_from].blocks[: num_cached // self.bs]
            for b in r.blocks:
                self.refs[b] += 1
            r.num_computed = num_cached
        self.reqs[req_id] = r
        return r

    def _take(self, r: Req, upto: int) -> None:
        while len(r.blocks) * self.bs < upto:
            b = self.free.pop()
            self.refs[b] = 1
            r.blocks.append(b)
            r.new_blocks.append(b)

    def _release(self, r: Req) -> None:
        for b in r.blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
        r.blocks, r.new_blocks = [], []

    def preempt(self, req_id: str) -> None:
        """Recompute mode: blocks freed, tokens recomputed on resume."""
        r = self.reqs[req_id]
        self._release(r)
        r.num_computed, r.running = 0, False
        self.preempted.add(req_id)

    def swap_out(self, req_id: str) -> list[int]:
        r = self.reqs[req_id]
        old = list(r.blocks)
        r.host_blocks = [self.host_free.pop() for _ in old]
        self.swap_out_pairs += list(zip(old, r.host_blocks, strict=True))
        self._release(r)
        r.running = False
        self.preempted.add(req_id)
        return old

    def swap_in(self, req_id: str) -> list[int]:
        r = self.reqs[req_id]
        for h in r.host_blocks:
            b = self.free.pop()
            self.refs[b] = 1
            r.blocks.append(b)
            self.swap_in_pairs.append((b, h))
            self.host_free.append(h)
        r.host_blocks = []
        r.running = r.resumed = True
        return list(r.blocks)

    def resume(self, req_id: str) -> None:
        r = self.reqs[req_id]
        r.running = r.resumed = True

    def step(self) -> dict[str, list[int]]:
        so = SchedulerOutput(step_id=0)
        for r in self.reqs.values():
            if not r.running or r.done:
                continue
            n = len(r.prompt) + len(r.outputs) - r.num_computed
            if self.chunk:
                n = min(n, self.chunk)
            self._take(r, r.num_computed + n)
            if not r.sent:
                so.new_requests.append(
                    NewRequestData(
                        r.req_id,
                        r.prompt,
                        r.params,
                        list(r.blocks),
                        r.num_computed,
                        list(r.outputs),
                    )
                )
                r.sent = True
            elif r.resumed:
                so.cached_requests.append(
                    CachedRequestData(r.req_id, list(r.blocks), r.num_computed, True, r.outputs[:])
                )
            else:
                so.cached_requests.append(CachedRequestData(r.req_id, r.new_blocks, r.num_computed))
            r.new_blocks, r.resumed = [], False
            so.num_scheduled_tokens[r.req_id] = n
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        so.finished_req_ids, self.finished = self.finished, set()
        so.preempted_req_ids, self.preempted = self.preempted, set()
        so.blocks_to_swap_out, self.swap_out_pairs = self.swap_out_pairs, []
        so.blocks_to_swap_in, self.swap_in_pairs = self.swap_in_pairs, []
        out = self.runner.execute_model(so)
        assert set(out.sampled_token_ids) == set(so.num_scheduled_tokens)
        for req_id, n in so.num_scheduled_tokens.items():
            r = self.reqs[req_id]
            r.num_computed += n
            tokens = out.sampled_token_ids[req_id]
            partial = r.num_computed < len(r.prompt) + len(r.outputs)
            assert tokens == [] if partial else len(tokens) == 1
            r.outputs += tokens
            if len(r.outputs) >= r.max_tokens:
                r.done = True
                self._release(r)
                self.finished.add(req_id)
        return out.sampled_token_ids

    def run(self) -> dict[str, list[int]]:
        while any(r.running and not r.done for r in self.reqs.values()):
            self.step()
        return {k: r.outputs for k, r in self.reqs.items()}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def _setup(model_dir, runner_cfg: ModelRunnerConfig, prompts, n, chunk):
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(runner_cfg)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = {}
    with torch.no_grad():
        for i, p in enumerate(prompts):
            refs[f"p{i}"] = hf_greedy(hf, p, n)
    return SimpleNamespace(
        runner=runner, hf=hf, prompts=prompts, refs=refs, n=n, chunk=chunk, bs=runner.block_size
    )


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def env(request):
    if request.param == "tiny":
        model_dir = request.getfixturevalue("tiny_llama_dir")
        rng = random.Random(1)
        prompts = [[rng.randrange(3, 512) for _ in range(k)] for k in (3, 9, 17, 30, 41)]
        cfg = ModelRunnerConfig(
            model=str(model_dir), block_size=4, num_gpu_blocks=160, num_host_blocks=32
        )
        return _setup(model_dir, cfg, prompts, n=12, chunk=5)
    from common.model_source import resolve_model
    from common.tokenizer import load_tokenizer
    from worker_svc.model_loader import model_dir as converted

    source = resolve_model(None)
    tok = load_tokenizer(source)
    questions = [
        "What is 2+2?",
        "Name three colors of the rainbow and describe each briefly.",
        "Hi",
    ]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    cfg = ModelRunnerConfig(model=None, block_size=16, num_gpu_blocks=48, num_host_blocks=16)
    return _setup(converted(source), cfg, prompts, n=16, chunk=16)


def check(env, outputs: dict[str, list[int]], ids=None) -> None:
    for req_id in ids or outputs:
        ref = env.refs[req_id]
        assert outputs[req_id][: len(ref)] == ref, req_id  # HF stops at EOS; the runner not


def test_one_request_alone(env):
    for i, p in enumerate(env.prompts):
        d = Driver(env.runner)
        d.add(f"p{i}", p, env.n)
        check(env, d.run())


def test_many_in_one_batch(env):
    d = Driver(env.runner)
    for i, p in enumerate(env.prompts):
        d.add(f"p{i}", p, env.n)
    check(env, d.run())


def test_chunked_prefill_beside_decodes(env):
    d = Driver(env.runner, chunk=env.chunk)
    longest = max(range(len(env.prompts)), key=lambda i: len(env.prompts[i]))
    others = [i for i in range(len(env.prompts)) if i != longest]
    for i in others:
        d.add(f"p{i}", env.prompts[i], env.n)
    for _ in range(3):
        d.step()
    d.add(f"p{longest}", env.prompts[longest], env.n)
    partial = 0
    while not d.reqs[f"p{longest}"].done:
        out = d.step()
        partial += out[f"p{longest}"] == []
    assert partial >= 1  # the long prompt really was split over steps
    check(env, d.run())


def test_prefix_cache_hit(env):
    b = max(range(len(env.prompts)), key=lambda i: len(env.prompts[i]))
    base = env.prompts[b]
    k = (len(base) - 1) // env.bs * env.bs  # full blocks shared, at least one token computed
    assert k > 0
    hit = base[:k] + env.prompts[0]
    with torch.no_grad():
        ref = hf_greedy(env.hf, hit, env.n)
    d = Driver(env.runner)
    d.add(f"p{b}", base, env.n)
    d.step()  # base's prompt KV is written
    d.add("hit", hit, env.n, share_from=f"p{b}", num_cached=k)
    d.step()
    assert d.reqs["hit"].blocks[: k // env.bs] == d.reqs[f"p{b}"].blocks[: k // env.bs]
    outputs = d.run()
    assert outputs["hit"][: len(ref)] == ref
    check(env, outputs, [f"p{b}"])


def test_preempt_and_recompute(env):
    d = Driver(env.runner)
    d.add("p0", env.prompts[0], env.n)
    d.add("p1", env.prompts[1], env.n)
    for _ in range(3):
        d.step()
    d.preempt("p0")
    d.add("p2", env.prompts[2], env.n)  # takes p0's freed blocks and overwrites them
    for _ in range(2):
        d.step()
    d.resume("p0")
    check(env, d.run(), ["p0", "p1", "p2"])


def test_swap_out_and_in(env):
    d = Driver(env.runner)
    d.add("p0", env.prompts[0], env.n)
    d.add("p1", env.prompts[1], env.n)
    for _ in range(3):
        d.step()
    old = d.swap_out("p0")
    d.add("p2", env.prompts[2], env.n)  # reuses (overwrites) p0's device blocks
    for _ in range(2):
        d.step()
    assert set(old) & set(d.reqs["p2"].blocks), "the test wants p0's old blocks overwritten"
    new = d.swap_in("p0")
    assert new != old
    check(env, d.run(), ["p0", "p1", "p2"])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_architectures(arch, tmp_path):
    """Attention bias (Qwen2), q/k norms (Qwen3), Mistral: same path, same greedy tokens."""
    import transformers

    cls, config_cls = {
        "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
        "mistral": ("MistralForCausalLM", "MistralConfig"),
    }[arch]
    config = getattr(transformers, config_cls)(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    getattr(transformers, cls)(config).save_pretrained(tmp_path)
    rng = random.Random(2)
    prompts = [[rng.randrange(300) for _ in range(k)] for k in (5, 23, 11)]
    runner = ModelRunner(ModelRunnerConfig(model=str(tmp_path), block_size=4, num_gpu_blocks=64))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        refs = {f"p{i}": hf_greedy(hf, p, 8) for i, p in enumerate(prompts)}
    d = Driver(runner, chunk=7)
    for i, p in enumerate(prompts):
        d.add(f"p{i}", p, 8)
    assert d.run() == refs


@pytest.mark.parametrize("kernels", ["reference", "native"])
def test_kernels_keep_hf_equality(kernels, tiny_llama_dir):
    """Both op backends (reference: torch only; native: this CPU's kernels, each falling back
    to torch's op where it has none) give the same greedy tokens as HF, chunked prefill beside
    decodes included."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(k)] for k in (4, 13, 29)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        refs = {f"p{i}": hf_greedy(hf, p, 10) for i, p in enumerate(prompts)}
    cfg = ModelRunnerConfig(
        model=str(tiny_llama_dir), kernels=kernels, block_size=4, num_gpu_blocks=64
    )
    runner = ModelRunner(cfg)
    if kernels == "reference":
        assert runner.decode_kernel is None and runner.linear_kind == "torch"
    d = Driver(runner, chunk=6)
    for i, p in enumerate(prompts):
        d.add(f"p{i}", p, 10)
    check(SimpleNamespace(refs=refs), d.run())
