"""What a chat body passes to the chat template: reasoning_effort, verbosity and vLLM's
chat_template_kwargs as variables, add_generation_prompt, and continue_final_message (the
last assistant message left open for the model to go on with). Read off the prompt the worker
got."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.frontend.http_harness import TOK, ScriptedWorker, post, says, serve

# ChatML, and the variables a reasoning model's template reads
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}"
    "{% if verbosity is defined %}[verbosity={{ verbosity }}]{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}[no_think]{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VARIABLES_TOK = replace(TOK, chat_template=TEMPLATE)
USER = [{"role": "user", "content": "What is the capital of France?"}]
STARTED = [*USER, {"role": "assistant", "content": "The capital of France is"}]


def prompt_of(fields: dict, tokenizer=TOK, messages=USER) -> str:
    """The prompt the worker was sent for a chat body with `fields`."""
    worker = ScriptedWorker(says(" Paris."))
    response = post("/v1/chat/completions", {"messages": messages, **fields}, worker, tokenizer)
    assert response.status_code == 200, response.text
    (prompt,) = worker.prompts
    return prompt


def refusal(fields: dict, messages=STARTED) -> dict:
    response = post("/v1/chat/completions", {"messages": messages, **fields})
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_reasoning_effort_and_verbosity_reach_the_template():
    prompt = prompt_of({"reasoning_effort": "low", "verbosity": "high"}, VARIABLES_TOK)
    assert prompt.endswith("[effort=low][verbosity=high]<|im_start|>assistant\n")
    assert "[effort" not in prompt_of({}, VARIABLES_TOK)


def test_the_official_client_sends_them_too():
    worker = ScriptedWorker(says(" Paris."))

    async def fn(http, oai):
        return await oai.chat.completions.create(
            model="fake", messages=USER, reasoning_effort="minimal", verbosity="low"
        )

    serve(fn, worker, VARIABLES_TOK)
    assert "[effort=minimal][verbosity=low]" in worker.prompts[0]


def test_a_template_that_does_not_read_them_renders_the_same():
    assert prompt_of({"reasoning_effort": "high", "verbosity": "low"}) == prompt_of({})


def test_chat_template_kwargs_reach_the_template():
    prompt = prompt_of({"chat_template_kwargs": {"enable_thinking": False}}, VARIABLES_TOK)
    assert prompt.endswith("[no_think]<|im_start|>assistant\n")
    both = {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "low"}}
    assert "[effort=low]" in prompt_of(both, VARIABLES_TOK)


@pytest.mark.parametrize(
    "key", ["messages", "tools", "add_generation_prompt", "bos_token", "raise_exception"]
)
def test_chat_template_kwargs_cannot_replace_the_servers_variables(key):
    error = refusal({"chat_template_kwargs": {key: []}}, USER)
    assert error["param"] == f"chat_template_kwargs.{key}", error
    assert "cannot set" in error["message"]


def test_reasoning_effort_given_twice_must_agree():
    fields = {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
    error = refusal(fields, USER)
    assert error["param"] == "reasoning_effort" and "send one" in error["message"]


def test_reasoning_effort_outside_openais_values_is_refused():
    assert refusal({"reasoning_effort": "extreme"}, USER)["param"] == "reasoning_effort"


# ---- add_generation_prompt and continue_final_message ----------------------------------------
def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened():
    assert prompt_of({}).endswith("<|im_end|>\n<|im_start|>assistant\n")
    prompt = prompt_of({"add_generation_prompt": False})
    assert prompt.endswith("What is the capital of France?<|im_end|>\n")


@pytest.mark.parametrize(
    "fields",
    [
        {"continue_final_message": True, "add_generation_prompt": False},
        {"continue_final_message": True},  # left out beside it: no generation prompt
    ],
)
def test_continue_final_message_leaves_the_assistant_text_open(fields):
    prompt = prompt_of(fields, messages=STARTED)
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    assert prompt.count("<|im_start|>assistant") == 1


def test_continue_final_message_answers_with_the_continuation():
    worker = ScriptedWorker(says(" Paris."))
    body = {"messages": STARTED, "continue_final_message": True}
    response = post("/v1/chat/completions", body, worker)
    assert response.json()["choices"][0]["message"]["content"] == " Paris."


def test_without_it_the_assistant_message_is_closed_and_a_new_one_opened():
    prompt = prompt_of({}, messages=STARTED)
    assert prompt.endswith("The capital of France is<|im_end|>\n<|im_start|>assistant\n")


def test_continue_final_message_with_add_generation_prompt_is_refused():
    error = refusal({"continue_final_message": True, "add_generation_prompt": True})
    assert error["param"] == "continue_final_message"
    assert "cannot both be true" in error["message"]


@pytest.mark.parametrize(
    "messages",
    [USER, [*USER, {"role": "assistant", "content": ""}]],
    ids=["last is the user's", "empty assistant message"],
)
def test_continue_final_message_needs_an_assistant_text_last(messages):
    error = refusal({"continue_final_message": True}, messages)
    assert error["param"] == "continue_final_message" and "assistant" in error["message"]


def test_a_template_that_trims_the_content_is_continued_after_the_trimmed_text():
    trimming = replace(TOK, chat_template=TEMPLATE.replace("m['content']", "m['content'] | trim"))
    messages = [*USER, {"role": "assistant", "content": "The capital of France is "}]
    prompt = prompt_of({"continue_final_message": True}, trimming, messages)
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France is")
