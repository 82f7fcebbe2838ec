"""Turn a client's GenerateRequest into a validated ClientRequest (or a clear rejection)."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import replace

from common import structured
from common.convert import sampling_from_proto
from common.messages import StructuredOutput
from common.outcomes import PRIORITY_RANGE, RequestRejected
from common.pb import generation_pb2 as gen_pb
from common.sampling_checks import validate_sampling_params
from frontend_svc.client_request import ClientRequest
from frontend_svc.detokenizer import IncrementalDetokenizer

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_REQUEST_ID_LEN = 256
MAX_TENANT_LEN = 128
MAX_LOGPROBS = 20
MAX_CHOICES = 16  # n and best_of
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties, as OpenAI's API


class FieldRejected(RequestRejected):
    """A refusal that names the request field at fault (`max_tokens`, `stop`, `prompt`...):
    the HTTP API's error `param`; gRPC answers INVALID_ARGUMENT with the sentence alike.
    `structured` stands for whichever field asked for the output constraint."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_service_limits(params) -> None:
    """Limits of this service on top of the core's validation."""
    low, high = PENALTY_RANGE
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not low <= value <= high:  # also refuses NaN
            raise FieldRejected(name, f"{name} must be in [{low:g}, {high:g}]; got {value!r}")
    if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
        raise FieldRejected(
            "logprobs", f"logprobs must be at most {MAX_LOGPROBS}; got {params.logprobs}"
        )


def check_stop_strings(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_LEN for s in stop):
        raise FieldRejected(
            "stop", f"at most {MAX_STOP_STRINGS} stop strings of {MAX_STOP_STRING_LEN} characters"
        )


class Intake:
    """Validation and tokenization shared by the gRPC and HTTP front ends. Tokenizing costs
    about a microsecond a byte: callers run what tokenizes (build, render_chat, encode_prompt)
    on a thread, never on the event loop."""

    def __init__(self, tokenizer, model_name: str, aliases: set[str], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        # the byte table the detokenizers share, built now rather than on the first request
        byte_pieces = getattr(tokenizer, "byte_pieces", None)
        if byte_pieces is not None:
            byte_pieces()
        self.model_name = model_name
        self.aliases = aliases | {model_name}
        self.max_model_len = max_model_len
        self.vocab_size = tokenizer.vocab_size
        self.length_bound = tokenizer.length_bound()  # None: no check before tokenizing
        # the LoRA adapters requests may name as their model (the leader's, as last heard)
        self.lora_names: Callable[[], Collection[str]] = tuple
        self._ll_tokenizer = None  # llguidance's view of the tokenizer, on first use

    def check_structured(self, params) -> None:
        """A constraint must compile against this model's tokenizer (the reason otherwise),
        and EOS must be able to end the request."""
        if params.structured is None:
            return
        if params.ignore_eos:
            raise FieldRejected(
                "ignore_eos",
                "ignore_eos cannot be combined with structured output: EOS ends the output "
                "once it is complete",
            )
        self.check_constraint(params.structured)

    def check_constraint(self, constraint: StructuredOutput, field: str = "structured") -> None:
        """The constraint compiles against this model's tokenizer, else the reason."""
        if self._ll_tokenizer is None:
            self._ll_tokenizer = structured.ll_tokenizer(
                self.tokenizer, self.tokenizer.eos_token_id
            )
        try:
            structured.check(constraint, self._ll_tokenizer)
        except structured.InvalidConstraint as exc:
            raise FieldRejected(field, str(exc)) from None

    def check_model(self, model: str) -> str:
        """The LoRA adapter `model` names ("" for the base model or none named); FieldRejected
        when it names neither."""
        if not model or model in self.aliases:
            return ""
        adapters = self.lora_names()
        if model in adapters:
            return model
        served = f"{self.model_name!r}"
        if adapters:
            served += " and the adapters " + ", ".join(repr(a) for a in sorted(adapters))
        raise FieldRejected("model", f"unknown model {model!r}; this server serves {served}")

    def prompt_from_proto(self, request: gen_pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "text":
            if not request.text:
                raise FieldRejected("prompt", "the prompt is empty; send some text or token ids")
            return self.encode_prompt(request.text)
        if kind == "token_ids":
            return self.check_token_ids(list(request.token_ids.ids))
        if kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            return self.render_chat(messages)
        raise FieldRejected("prompt", "the prompt is empty; send text, token_ids or chat messages")

    def render_chat(self, messages: list[dict], **template_context) -> list[int]:
        """`template_context`: more template variables (`tools`, as transformers passes them)."""
        if not messages:
            raise FieldRejected("messages", "the chat has no messages; send at least one")
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "user", "assistant", "tool"):
                raise FieldRejected(
                    f"messages.{i}.role",
                    f"unknown chat role {m.get('role')!r}; use system, user or assistant",
                )
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, **template_context)
        return self.encode_prompt(text, add_special_tokens=False)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids, unless it is certainly too long to run (check_text_length)."""
        self.check_text_length(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_text_length(self, text: str) -> None:
        """Refuse a prompt text certainly over max_model_len before tokenizing it, with the
        refusal make_state gives after. The bound (bytes / the longest token, LengthBound) is
        sound, never over the true count: a prompt just over the limit is left to the exact
        count, one far over costs a pass over its bytes instead of a microsecond a byte."""
        if self.length_bound is None:
            return
        least = self.length_bound.least_tokens(text)
        if least >= self.max_model_len:
            raise FieldRejected(
                "prompt",
                f"the prompt has at least {least} tokens but max_model_len is "
                f"{self.max_model_len}; shorten the prompt",
            )

    def check_token_ids(self, ids: list[int], field: str = "prompt") -> list[int]:
        for tok in ids:
            if tok < 0 or tok >= self.vocab_size:
                raise FieldRejected(
                    field,
                    f"token id {tok} in {field} is outside the vocabulary "
                    f"(0..{self.vocab_size - 1})",
                )
        return ids

    def encode_prediction(self, text: str) -> tuple[int, ...]:
        """A predicted output's token ids (Predicted Outputs), at most max_model_len of them:
        a text certainly longer is refused before tokenizing (as a prompt is)."""
        bound = self.length_bound
        if bound is not None and bound.least_tokens(text) > self.max_model_len:
            raise FieldRejected(
                "prediction", f"the prediction is longer than max_model_len {self.max_model_len}"
            )
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def check_prediction(self, ids: tuple[int, ...]) -> None:
        """At most max_model_len token ids, each in the vocabulary (gRPC sends token ids)."""
        if len(ids) > self.max_model_len:
            raise FieldRejected(
                "prediction",
                f"the prediction has {len(ids)} tokens but max_model_len is {self.max_model_len}",
            )
        self.check_token_ids(list(ids), "prediction")

    def max_tokens_for(self, prompt_len: int, asked: int | None, default: int | None) -> int:
        """`asked` as it is (make_state refuses it over the remaining context, as OpenAI and
        vLLM do: nothing is cut silently); unset, `default` (None: all of it) cut to the
        context the prompt leaves."""
        room = max(1, self.max_model_len - prompt_len)  # a prompt too long: make_state says so
        if asked is not None:
            return asked
        return room if default is None else min(default, room)

    def build(self, request: gen_pb.GenerateRequest) -> ClientRequest:
        lora_name = self.check_model(request.model)
        if request.lora_name:
            named = self.check_model(request.lora_name)
            if not named or (request.model and named != lora_name):
                raise FieldRejected(
                    "lora_name",
                    f"lora_name {request.lora_name!r} is not an adapter of this server or "
                    f"disagrees with model {request.model!r}",
                )
            lora_name = named
        if len(request.request_id) > MAX_REQUEST_ID_LEN:
            raise FieldRejected(
                "request_id", f"request_id is longer than {MAX_REQUEST_ID_LEN} characters"
            )
        params, stop = sampling_from_proto(request.sampling)
        validate_sampling_params(params)
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        check_stop_strings(stop)
        for name in ("deadline_s", "ttft_target_s", "tpot_target_s"):
            value = getattr(request, name)
            if not math.isfinite(value) or value < 0:
                raise FieldRejected(name, f"{name} must be a finite number of seconds >= 0")
        prompt = self.prompt_from_proto(request)
        asked = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else None
        params.max_tokens = self.max_tokens_for(len(prompt), asked, params.max_tokens)
        state = self.make_state(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt=prompt,
            params=params,
            stop=stop,
            priority=request.priority,
            tenant=request.tenant or None,
            deadline_s=request.deadline_s,
            skip_special_tokens=not request.include_special_tokens,
            ttft_target_s=request.ttft_target_s,
            tpot_target_s=request.tpot_target_s,
        )
        state.lora_name = lora_name
        return state

    def build_group(self, request: gen_pb.GenerateRequest) -> list[ClientRequest]:
        """The request's n samples (see siblings); one state for n = 0 or 1."""
        if request.n > MAX_CHOICES:
            raise FieldRejected("n", f"n must be in [1, {MAX_CHOICES}]; got {request.n}")
        first = self.build(request)
        return [first] + self.siblings(first, max(1, request.n))

    def siblings(self, first: ClientRequest, count: int) -> list[ClientRequest]:
        """The other count - 1 samples of `first`'s prompt, ids `{first}-{i}`, with its stop
        strings, text settings, deadline and targets. Each has its own seed stream (seed + i)
        and waits for the first one's prompt to be computed (and cached), so the prompt's KV
        blocks are computed once and shared through the prefix cache; only the partial last
        block is computed again per sample."""
        detok = first.detokenizer
        group = []
        for i in range(1, count):
            params = first.params
            if params.seed is not None:
                params = replace(params, seed=params.seed + i)
            sibling = self.make_state(
                request_id=f"{first.request_id}-{i}",
                prompt=first.prompt_token_ids,
                params=params,
                stop=detok.stop_strings,
                priority=first.priority,
                tenant=first.tenant,
                skip_special_tokens=detok.skip_special_tokens,
                include_stop_str_in_output=detok.include_stop,
                ttft_target_s=first.ttft_target_s or 0.0,
                tpot_target_s=first.tpot_target_s or 0.0,
            )
            sibling.deadline = first.deadline
            sibling.prefill_after = first.request_id
            sibling.lora_name = first.lora_name
            group.append(sibling)
        return group

    def make_state(
        self,
        request_id,
        prompt,
        params,
        stop,
        priority=0,
        tenant=None,
        deadline_s=0.0,
        skip_special_tokens=True,
        ttft_target_s=0.0,
        tpot_target_s=0.0,
        include_stop_str_in_output=False,
    ) -> ClientRequest:
        """`include_stop_str_in_output`: a matched stop string stays at the end of the text."""
        if not prompt:
            raise FieldRejected("prompt", "the prompt is empty after tokenization")
        if len(prompt) >= self.max_model_len:
            raise FieldRejected(
                "prompt",
                f"the prompt has {len(prompt)} tokens but max_model_len is {self.max_model_len}; "
                "shorten the prompt",
            )
        room = self.max_model_len - len(prompt)
        if isinstance(params.max_tokens, int) and params.max_tokens > room:
            raise FieldRejected(
                "max_tokens",
                f"max_tokens is {params.max_tokens} but max_model_len {self.max_model_len} "
                f"leaves {room} after the prompt's {len(prompt)} tokens; ask for at most {room}, "
                "or leave max_tokens out to generate up to the remaining context",
            )
        min_tokens, max_tokens = params.min_tokens, params.max_tokens
        if isinstance(min_tokens, int) and isinstance(max_tokens, int) and min_tokens > max_tokens:
            raise FieldRejected(
                "min_tokens",
                f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})",
            )
        validate_sampling_params(params)
        check_service_limits(params)
        self.check_structured(params)
        if params.prediction:
            self.check_prediction(params.prediction)
        low, high = PRIORITY_RANGE
        if not low <= priority <= high:
            raise FieldRejected("priority", f"priority {priority} is outside [{low}, {high}]")
        if tenant is not None and (len(tenant) > MAX_TENANT_LEN or not tenant.isprintable()):
            raise FieldRejected(
                "tenant", f"tenant must be printable and at most {MAX_TENANT_LEN} characters"
            )
        now = time.monotonic()
        return ClientRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            detokenizer=IncrementalDetokenizer.for_prompt(
                self.tokenizer, prompt, skip_special_tokens, stop, include_stop_str_in_output
            ),
            priority=priority,
            tenant=tenant,
            deadline=now + deadline_s if deadline_s else None,
            ttft_target_s=ttft_target_s or None,
            tpot_target_s=tpot_target_s or None,
            eos_token_id=self.tokenizer.eos_token_id,
            arrival_time=now,
        )
