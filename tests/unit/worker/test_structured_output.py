"""Structured output on the worker (worker_svc/structured_output.py), on the simulated runner and
on a tiny random Llama with a small byte-level tokenizer, driven by the real scheduler core: the
grammar holds whatever the weights and the sampling settings, EOS ends a complete output, and
unconstrained rows beside constrained ones sample exactly what they would alone."""

from __future__ import annotations

import json
import re
import shutil
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from structlog.testing import capture_logs  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

from common.messages import (  # noqa: E402
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    StructuredOutput,
)
from common.tokenizer import load_tokenizer  # noqa: E402
from scheduler_svc.core.request import FinishReason  # noqa: E402
from tests.factories import request, scheduler_factory  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402
from worker_svc.sampler import apply_token_mask, token_masks  # noqa: E402
from worker_svc.sim_runner import SimConfig, SimRunner  # noqa: E402
from worker_svc.structured_output import THREAD_NAME, StructuredOutputs, eos_mask  # noqa: E402

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "admin"],
    "additionalProperties": False,
}
JSON_SCHEMA = StructuredOutput("json_schema", json.dumps(SCHEMA))
REGEX = r"[a-z]{2,5}-[0-9]{2,3}"
CHOICES = ["yes", "no", "maybe", "maybe not"]
CHOICE = StructuredOutput("choice", json.dumps(CHOICES))
PROMPTS = [[5, 80, 31, 200, 7], [44, 9, 120], [300, 301, 17, 99, 250, 6, 11]]

make_scheduler = scheduler_factory(
    max_num_batched_tokens=64, max_num_seqs=16, block_size=4, num_blocks=256, max_model_len=512
)


def valid_person(doc) -> bool:
    """SCHEMA, checked by hand."""
    if (
        not isinstance(doc, dict)
        or not {"name", "age", "admin"} <= doc.keys() <= SCHEMA["properties"].keys()
    ):
        return False
    age, tags = doc["age"], doc.get("tags", [])
    return (
        isinstance(doc["name"], str)
        and len(doc["name"]) <= 6
        and isinstance(age, int)
        and not isinstance(age, bool)
        and 0 <= age <= 120
        and isinstance(doc["admin"], bool)
        and isinstance(tags, list)
        and len(tags) <= 3
        and all(t in ("a", "b", "c") for t in tags)
    )


# --- the models ---

SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny Llama's pad, bos, eos
WORDS = ['{"', '":', '",', "true", "false", "yes", "no", "maybe", "name", "age", "admin", "12"]


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE: the specials, the 256 byte symbols, and the prefixes of a few words
    (290 tokens, fewer than the model's 512 logits)."""
    vocab = {t: i for i, t in enumerate(SPECIAL + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = []
    for word in WORDS:
        for n in range(2, len(word) + 1):
            if word[:n] not in vocab:
                merges.append((word[: n - 1], word[n - 1]))
                vocab[word[:n]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    return tok


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny random Llama with a tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama-tokenizer") / "model"
    shutil.copytree(tiny_llama_dir, path)
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(str(model_dir))


def new_sim(model_dir) -> SimRunner:
    cfg = SimConfig(simulate=True, sim_step_base_ms=0, sim_step_per_token_us=0, sim_num_blocks=256)
    cfg.sim_vocab_size = 512
    return SimRunner(cfg, str(model_dir), block_size=4, max_model_len=512)


def new_llama(model_dir) -> ModelRunner:
    cfg = ModelRunnerConfig(model=str(model_dir), block_size=4, num_gpu_blocks=256, num_threads=1)
    return ModelRunner(cfg)


@pytest.fixture(scope="module", params=["sim", "llama"])
def runner(request, model_dir):
    runner = new_sim(model_dir) if request.param == "sim" else new_llama(model_dir)
    yield runner
    runner.reset()


def generate(runner, requests, stats=None, **scheduler_overrides):
    """Run `requests` (core Requests) to the end on `runner` through a fresh scheduler;
    returns {request id: (output tokens, finish reason)}; `stats` gets the scheduler's."""
    runner.reset()
    sched = make_scheduler(**scheduler_overrides)
    for r in requests:
        sched.add_request(r)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, runner.execute_model(out).sampled_token_ids)
    if stats is not None:
        stats.update(sched.stats())
    return {r.request_id: (list(r.output_token_ids), r.finish_reason) for r in requests}


def req(rid, prompt, structured=None, *, temperature=0.0, max_tokens=200, **kw):
    return request(
        rid,
        prompt,
        max_tokens=max_tokens,
        eos=EOS,
        temperature=temperature,
        structured=structured,
        **kw,
    )


def text(tokenizer, tokens) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


# --- tests ---


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_json_schema_output_parses_and_matches_the_schema(runner, tokenizer, temperature):
    reqs = [
        req(f"j{i}", p, JSON_SCHEMA, temperature=temperature, seed=100 + i)
        for i, p in enumerate(PROMPTS * 2)
    ]
    for rid, (tokens, reason) in generate(runner, reqs).items():
        assert reason is FinishReason.STOP and tokens[-1] == EOS, rid
        doc = json.loads(text(tokenizer, tokens))
        assert valid_person(doc), (rid, doc)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 2.0])
def test_regex_and_choice_outputs_match(runner, tokenizer, temperature):
    reqs = [
        req(f"r{i}", p, StructuredOutput("regex", REGEX), temperature=temperature, seed=i)
        for i, p in enumerate(PROMPTS)
    ] + [req(f"c{i}", p, CHOICE, temperature=temperature, seed=i) for i, p in enumerate(PROMPTS)]
    for rid, (tokens, reason) in generate(runner, reqs).items():
        assert reason is FinishReason.STOP and tokens[-1] == EOS, rid
        if rid.startswith("r"):
            assert re.fullmatch(REGEX, text(tokenizer, tokens)), (rid, text(tokenizer, tokens))
        else:
            assert text(tokenizer, tokens) in CHOICES, (rid, text(tokenizer, tokens))


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(runner):
    """Greedy and seeded rows sample exactly what they sample in a batch of their own."""
    plain = [
        req("g0", PROMPTS[0], max_tokens=12),
        req("g1", PROMPTS[1], max_tokens=12),
        req("s0", PROMPTS[2], temperature=1.0, seed=7, max_tokens=12),
    ]
    alone = generate(runner, plain)
    constrained = [
        req(f"j{i}", p, JSON_SCHEMA, temperature=1.0, seed=i) for i, p in enumerate(PROMPTS)
    ]
    constrained.append(req("c", PROMPTS[0], CHOICE))
    plain = [req(r.request_id, r.prompt_token_ids, **_params(r)) for r in plain]
    mixed = generate(runner, constrained + plain)
    assert {rid: mixed[rid] for rid in alone} == alone


def _params(r):
    p = r.sampling_params
    return {"max_tokens": p.max_tokens, "temperature": p.temperature, "seed": p.seed}


def test_max_tokens_first_gives_a_prefix_with_length(runner):
    full = generate(runner, [req("a", PROMPTS[0], JSON_SCHEMA)])["a"][0]
    assert len(full) > 5
    tokens, reason = generate(runner, [req("a", PROMPTS[0], JSON_SCHEMA, max_tokens=5)])["a"]
    assert reason is FinishReason.LENGTH and tokens == full[:5]


@pytest.mark.parametrize("structured", [JSON_SCHEMA, StructuredOutput("regex", REGEX)])
def test_readded_request_replays_its_tokens_and_continues(runner, tokenizer, structured):
    """A migration: another worker (here: the same one, reset) gets the request with the output
    tokens so far; its matcher replays them, so greedy continues token for token and a sampled
    output still matches as a whole."""
    full = generate(runner, [req("a", PROMPTS[1], structured)])["a"][0]
    cut = len(full) // 2
    moved = generate(runner, [req("a", PROMPTS[1], structured, out=full[:cut])])["a"][0]
    assert moved == full
    sampled = dict(temperature=1.0, seed=3)
    first = generate(runner, [req("b", PROMPTS[2], structured, max_tokens=4, **sampled)])
    tokens, reason = generate(
        runner, [req("b", PROMPTS[2], structured, out=first["b"][0], **sampled)]
    )["b"]
    assert reason is FinishReason.STOP and tokens[:4] == first["b"][0]
    if structured is JSON_SCHEMA:
        assert valid_person(json.loads(text(tokenizer, tokens)))
    else:
        assert re.fullmatch(REGEX, text(tokenizer, tokens))


def test_preempted_and_recomputed_requests_keep_their_output(runner):
    """Recompute preemption resumes a request with its tokens so far: same greedy output as
    with room for everyone."""

    def reqs():
        return [
            req(f"p{i}{s.kind}", p * 3, s, max_tokens=60)
            for i, p in enumerate(PROMPTS)
            for s in (JSON_SCHEMA, CHOICE)
        ]

    roomy = generate(runner, reqs())
    stats = {}
    assert generate(runner, reqs(), stats, num_blocks=24) == roomy  # 96 tokens: one fits
    assert stats["num_preemptions"] > 0


def test_a_refused_token_forces_eos_and_is_logged(runner, tokenizer):
    wrong = tokenizer.encode("zz", add_special_tokens=False)
    bad_regex = StructuredOutput("regex", "[")
    with capture_logs() as logs:
        out = generate(
            runner, [req("a", PROMPTS[0], CHOICE, out=wrong), req("b", PROMPTS[1], bad_regex)]
        )
    assert out["a"] == ([*wrong, EOS], FinishReason.STOP)
    assert out["b"] == ([EOS], FinishReason.STOP)
    errors = {e["request_id"] for e in logs if e["event"] == "structured_output_error"}
    assert errors == {"a", "b"}


@pytest.mark.parametrize("make_runner", [new_sim, new_llama])
def test_a_model_without_a_tokenizer_ends_constrained_requests_with_eos(
    make_runner, tiny_llama_dir
):
    runner = make_runner(tiny_llama_dir)  # config and weights only: no tokenizer.json
    with capture_logs() as logs:
        out = generate(runner, [req("a", PROMPTS[0], CHOICE), req("b", PROMPTS[1], max_tokens=3)])
    assert out["a"] == ([EOS], FinishReason.STOP)
    assert len(out["b"][0]) == 3
    (error,) = [e for e in logs if e["event"] == "structured_output_error"]
    assert error["request_id"] == "a" and "no tokenizer" in error["error"]


def test_logprobs_stay_the_raw_distribution(model_dir, tokenizer):
    """The mask decides the token, not what `logprobs` reports: the model's own distribution."""
    runner = new_llama(model_dir)

    def first_token(structured):
        runner.reset()
        params = SamplingParams(temperature=0.0, logprobs=5, structured=structured)
        so = SchedulerOutput(
            new_requests=[NewRequestData("a", PROMPTS[0], params, [0, 1], 0)],
            num_scheduled_tokens={"a": len(PROMPTS[0])},
            total_num_scheduled_tokens=len(PROMPTS[0]),
        )
        return runner.execute_model(so).logprobs["a"][0]

    plain, constrained = first_token(None), first_token(CHOICE)
    assert constrained.top == plain.top
    assert any(c.startswith(text(tokenizer, [constrained.token_id])) for c in CHOICES)


def test_no_thread_for_unconstrained_batches(model_dir):
    for runner in (new_sim(model_dir), new_llama(model_dir)):
        generate(runner, [req("a", PROMPTS[0], max_tokens=4), req("b", PROMPTS[1], max_tokens=4)])
        assert getattr(runner.structured, "thread_started", False) is False
        generate(runner, [req("c", PROMPTS[0], CHOICE)])
        assert runner.structured.thread_started


def test_matchers_run_on_the_background_thread_only(model_dir, monkeypatch):
    """Compile, replay, consume and mask all happen off the step's thread (so they overlap the
    next forward pass); the step only waits for them before sampling."""
    threads = set()
    fill = StructuredOutputs._fill

    def recording_fill(self, row):
        threads.add(threading.current_thread().name)
        fill(self, row)

    monkeypatch.setattr(StructuredOutputs, "_fill", recording_fill)
    runner, maybe = new_sim(model_dir), tiny_tokenizer().encode("may").ids
    generate(runner, [req("a", PROMPTS[0], JSON_SCHEMA), req("b", PROMPTS[1], CHOICE, out=maybe)])
    assert threads and all(name.startswith(THREAD_NAME) for name in threads)


def test_token_mask_pads_past_the_tokenizer_and_applies_to_its_rows_only():
    masks = np.stack([eos_mask(EOS, 40), eos_mask(33, 40)])  # 2 words: 64 bits
    for vocab in (40, 70):
        allowed = token_masks(masks, vocab, torch.device("cpu"))
        assert allowed.shape == (2, vocab)
        assert allowed[0].nonzero().flatten().tolist() == [EOS]
        assert allowed[1].nonzero().flatten().tolist() == [33]
    logits = torch.zeros(3, 70)
    apply_token_mask(logits, torch.tensor([2]), token_masks(masks[1:], 70, torch.device("cpu")))
    assert torch.isfinite(logits[:2]).all()
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [33]


def test_native_packed_mask_equals_the_torch_path():
    from worker_svc import token_mask

    native = token_mask.load()
    if native is None:
        pytest.skip("the native kernel library is not built on this machine")
    rng = np.random.default_rng(7)
    words = 5  # 160 tokens the masks cover
    masks = rng.integers(-(2**31), 2**31, size=(4, words), dtype=np.int64).astype(np.int32)
    masks[0, 1] = -1  # a word that allows everything
    masks[1, 2] = 0  # one that allows nothing
    masks[2] = 0
    masks[2, 0] = 1 << 3  # a single token
    for vocab, rows in ((150, [0, 1, 2, 3]), (200, [1, 3, 4, 6])):  # cut, and padded past
        logits = torch.randn(7, vocab)
        expected = logits.clone()
        picked = torch.tensor(rows, dtype=torch.int64)
        apply_token_mask(expected, picked, token_masks(masks, vocab, torch.device("cpu")))
        assert native(logits, picked, torch.from_numpy(masks))
        assert torch.equal(logits, expected)
    assert not native(torch.randn(2, 10, dtype=torch.bfloat16), picked[:1], torch.from_numpy(masks))
