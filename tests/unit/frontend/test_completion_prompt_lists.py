"""/v1/completions with a list of prompts (strings, token id lists): each prompt gets its own n
choices, numbered prompt_index * n + i as OpenAI and vLLM number them, streamed and not; usage
counts every prompt once and every generated token."""

from __future__ import annotations

import pytest

from frontend_svc.http.completion_prompts import MAX_COMPLETIONS
from tests.unit.frontend.http_harness import TOK, expected_text, post, serve, sse_events

TEXTS = ["The capital of France is", "One, two, three,", "Once upon a time"]
IDS = [TOK.encode(t) for t in TEXTS]
MAX_TOKENS = 5


def streamed_choices(text: str) -> tuple[dict[int, str], dict[int, str], dict | None]:
    """Each index's text and finish reason, and the usage chunk's usage."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for event in sse_events(text):
        if event == "[DONE]":
            continue
        if not event["choices"]:
            usage = event["usage"]
        for c in event["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                finish[c["index"]] = c["finish_reason"]
    return texts, finish, usage


@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "token ids"])
@pytest.mark.parametrize("n", [1, 2])
def test_each_prompt_gets_its_own_n_choices(as_ids, n):
    prompt = IDS if as_ids else TEXTS
    response = post("/v1/completions", {"prompt": prompt, "n": n, "max_tokens": MAX_TOKENS})
    assert response.status_code == 200, response.text
    out = response.json()
    assert [c["index"] for c in out["choices"]] == list(range(len(IDS) * n))
    for c in out["choices"]:
        assert c["text"] == expected_text(IDS[c["index"] // n], MAX_TOKENS)
        assert c["finish_reason"] == "length"
    assert out["usage"] == {
        "prompt_tokens": sum(map(len, IDS)),
        "completion_tokens": len(IDS) * n * MAX_TOKENS,
        "total_tokens": sum(map(len, IDS)) + len(IDS) * n * MAX_TOKENS,
    }
    assert len({expected_text(ids, MAX_TOKENS) for ids in IDS}) == len(IDS)  # they differ


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_chunks_carry_each_prompts_indexes_and_usage_sums_them(n):
    payload = {
        "prompt": TEXTS,
        "n": n,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = post("/v1/completions", payload)
    assert response.status_code == 200, response.text
    texts, finish, usage = streamed_choices(response.text)
    assert sorted(texts) == list(range(len(TEXTS) * n))
    for index, text in texts.items():
        assert text == expected_text(IDS[index // n], MAX_TOKENS)
    assert set(finish.values()) == {"length"} and len(finish) == len(texts)
    assert usage["prompt_tokens"] == sum(map(len, IDS))
    assert usage["completion_tokens"] == len(TEXTS) * n * MAX_TOKENS


def test_echo_gives_each_choice_its_own_prompt():
    response = post("/v1/completions", {"prompt": TEXTS[:2], "max_tokens": 3, "echo": True})
    choices = response.json()["choices"]
    for c in choices:
        assert c["text"] == TOK.decode(IDS[c["index"]]) + expected_text(IDS[c["index"]], 3)


def test_best_of_picks_within_each_prompt():
    payload = {"prompt": TEXTS[:2], "n": 1, "best_of": 2, "max_tokens": 3}
    out = post("/v1/completions", payload).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["text"] for c in out["choices"]] == [expected_text(ids, 3) for ids in IDS[:2]]
    assert out["usage"]["completion_tokens"] == 2 * 2 * 3  # the discarded choices count


def test_one_prompt_in_a_list_is_that_prompt():
    alone = post("/v1/completions", {"prompt": TEXTS[0], "max_tokens": 4}).json()
    listed = post("/v1/completions", {"prompt": [TEXTS[0]], "max_tokens": 4}).json()
    assert listed["choices"] == alone["choices"] and listed["usage"] == alone["usage"]


def test_the_official_client_reads_the_choices():
    async def fn(http, oai):
        return await oai.completions.create(
            model="fake", prompt=TEXTS[:2], n=2, max_tokens=MAX_TOKENS
        )

    completion = serve(fn)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert completion.choices[2].text == expected_text(IDS[1], MAX_TOKENS)
    assert completion.usage.prompt_tokens == len(IDS[0]) + len(IDS[1])


@pytest.mark.parametrize(
    ("prompt", "n", "param", "needle"),
    [
        ([], 1, "prompt", "empty"),
        ([[]], 1, "prompt", "empty"),
        ([[], [5]], 1, "prompt.0", "prompt[0] is empty"),
        (["a", ""], 1, "prompt.1", "prompt[1] is empty"),
        ([[1, 2], [10**6]], 1, "prompt.1", "outside the vocabulary"),
        (["x"] * (MAX_COMPLETIONS + 1), 1, "prompt", f"at most {MAX_COMPLETIONS}"),
        (["x"] * 5, 16, "prompt", "80 completions"),
    ],
)
def test_bad_prompt_lists_are_refused_naming_the_prompt(prompt, n, param, needle):
    response = post("/v1/completions", {"prompt": prompt, "n": n, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error
