"""What client libraries send, through a real scheduler and SmolLM2 worker: a list of prompts
answered prompt by prompt, and vLLM's stop_reason (null on EOS, the token id for a stop
token)."""

from __future__ import annotations

import pytest

from common.tokenizer import load_tokenizer
from tests.e2e.http_cluster import shared_http_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["The capital of France is", "One, two, three,"]
MAX_TOKENS = 8
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return shared_http_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def oai(cluster):
    return cluster.openai()


@pytest.fixture(scope="module")
def model(oai):
    (card,) = oai.models.list().data
    return card.id


def test_a_prompt_list_answers_each_prompt_as_if_alone(cluster, oai, model):
    alone = [oai.completions.create(model=model, prompt=p, **GREEDY) for p in PROMPTS]
    texts = [r.choices[0].text for r in alone]
    assert texts[0] != texts[1]
    listed = oai.completions.create(model=model, prompt=PROMPTS, n=2, **GREEDY)
    assert [c.index for c in listed.choices] == [0, 1, 2, 3]
    assert [c.text for c in listed.choices] == [texts[0], texts[0], texts[1], texts[1]]
    tok = load_tokenizer(None)
    assert listed.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert listed.usage.completion_tokens == 4 * MAX_TOKENS
    parts: dict[int, str] = {}
    for chunk in oai.completions.create(model=model, prompt=PROMPTS, stream=True, **GREEDY):
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + choice.text
    assert parts == {0: texts[0], 1: texts[1]}
    cluster.wait_idle()  # every request of the list ended and gave its blocks back


def test_stop_reason_is_null_on_eos_and_the_id_for_a_stop_token(cluster, oai, model):
    # a choice constraint ends with EOS once the answer is complete
    eos = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Capital of France?"}],
        max_tokens=16,
        temperature=0,
        extra_body={"guided_choice": ["Paris", "London"]},
    ).choices[0]
    assert eos.finish_reason == "stop" and eos.message.content in ("Paris", "London")
    assert eos.model_extra["stop_reason"] is None
    with cluster.grpc_client() as client:
        greedy = client.generate(
            PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
        )
    stop_at = greedy.token_ids[2]
    stopped = oai.completions.create(
        model=model,
        prompt=PROMPTS[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_at]},
    ).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.model_extra["stop_reason"] == stop_at
