"""Protobuf <-> core conversion: sampling params, and the step diff on both sides of the link."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from common.messages import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    StructuredOutput,
)
from common.outcomes import FinishReason
from common.pb import generation_pb2, sampling_pb2, worker_link_pb2

DEFAULT_MAX_TOKENS = 16


def sampling_from_proto(pb: sampling_pb2.SamplingParams) -> tuple[SamplingParams, list[str]]:
    """Proto to core params (defaults applied, nothing validated) plus the stop strings."""
    params = SamplingParams(
        max_tokens=pb.max_tokens if pb.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        min_tokens=pb.min_tokens,
        temperature=pb.temperature if pb.HasField("temperature") else 1.0,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        top_k=pb.top_k,
        min_p=pb.min_p,
        seed=pb.seed if pb.HasField("seed") else None,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
        stop_token_ids=list(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        structured=(
            StructuredOutput(pb.structured.kind, pb.structured.spec)
            if pb.HasField("structured")
            else None
        ),
        prediction=tuple(pb.prediction_token_ids),
    )
    return params, list(pb.stop)


def sampling_to_proto(
    params: SamplingParams, stop: list[str] | None = None, prediction: bool = True
) -> sampling_pb2.SamplingParams:
    """`prediction`: with the predicted output's tokens (to a scheduler; a worker needs none)."""
    pb = sampling_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        stop=stop or [],
    )
    if params.seed is not None:
        pb.seed = params.seed
    if params.logprobs is not None:
        pb.logprobs = params.logprobs
    if params.structured is not None:
        pb.structured.kind = params.structured.kind
        pb.structured.spec = params.structured.spec
    if prediction and params.prediction:
        pb.prediction_token_ids.extend(params.prediction)
    return pb


@dataclass(slots=True)
class HandleTable:
    """Small integer handles for request ids on one worker link, reused after release.

    A handle whose request's finish has been sent is retiring until the results of the steps
    that may still name it are in (release_handles): a request id placed again on the worker
    meanwhile (a resubmitted request) gets a handle of its own, never the retiring one."""

    by_id: dict[str, int] = field(default_factory=dict)
    by_handle: dict[int, str] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    next_handle: int = 1
    retiring: set[int] = field(default_factory=set)

    def assign(self, request_id: str) -> int:
        handle = self.by_id.get(request_id)
        if handle is not None and handle not in self.retiring:
            return handle
        handle = self.free.pop() if self.free else self._fresh()
        self.by_id[request_id] = handle
        self.by_handle[handle] = request_id
        return handle

    def _fresh(self) -> int:
        handle = self.next_handle
        self.next_handle += 1
        return handle

    def retire(self, request_id: str) -> int | None:
        """Its finish goes out in a step: the handle to name it by, kept until released."""
        handle = self.by_id.get(request_id)
        if handle is not None:
            self.retiring.add(handle)
        return handle

    def release_handles(self, handles: Iterable[int]) -> None:
        by_handle, by_id = self.by_handle, self.by_id
        for handle in handles:
            self.retiring.discard(handle)
            request_id = by_handle.pop(handle, None)
            if request_id is None:
                continue
            if by_id.get(request_id) == handle:
                del by_id[request_id]
            self.free.append(handle)


def encode_step(
    out: SchedulerOutput,
    handles: HandleTable,
    release: bool = True,
    into: worker_link_pb2.Step | None = None,
    epoch: int = 0,
) -> worker_link_pb2.Step:
    """The scheduler's diff as a Step (written into `into`, e.g. the step field of the message
    to send, when given: no copy), stamped with the leader's `epoch`. Handles of finished
    requests are released afterwards, unless `release` is False (a pipelined sender releases
    step.finished once every earlier step's result, which may still name them, is decoded)."""
    step = worker_link_pb2.Step() if into is None else into
    step.step_id = out.step_id
    if epoch:
        step.epoch = epoch
    sched = out.num_scheduled_tokens
    for req_id in out.finished_req_ids:
        handle = handles.retire(req_id)
        if handle is not None:
            step.finished.append(handle)
    for req_id in out.preempted_req_ids:
        handle = handles.by_id.get(req_id)
        if handle is not None:
            step.preempted.append(handle)
    for new in out.new_requests:
        step.new_requests.append(
            worker_link_pb2.NewRequest(
                handle=handles.assign(new.request_id),
                prompt_token_ids=new.prompt_token_ids,
                sampling=sampling_to_proto(new.sampling_params, prediction=False),
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                num_scheduled_tokens=sched.get(new.request_id, 0),
                output_token_ids=new.output_token_ids,
                request_id=new.request_id,
                lora_name=new.lora_name,
            )
        )
    by_id = handles.by_id
    col_handles: list[int] = []
    col_scheduled: list[int] = []
    col_computed: list[int] = []
    col_num_new: list[int] = []
    col_blocks: list[int] = []
    for cached in out.cached_requests:  # per running request per step: kept lean
        rid = cached.request_id
        if cached.resumed:
            step.cached_requests.add(
                handle=by_id[rid],
                num_scheduled_tokens=sched.get(rid, 0),
                num_computed_tokens=cached.num_computed_tokens,
                resumed=True,
                new_block_ids=cached.new_block_ids,
                new_token_ids=cached.new_token_ids,
            )
            continue
        col_handles.append(by_id[rid])
        col_scheduled.append(sched.get(rid, 0))
        col_computed.append(cached.num_computed_tokens)
        blocks = cached.new_block_ids
        if blocks:
            col_num_new.append(len(blocks))
            col_blocks.extend(blocks)
        else:
            col_num_new.append(0)
    if col_handles:
        running = step.running
        running.handles.extend(col_handles)
        running.num_scheduled_tokens.extend(col_scheduled)
        running.num_computed_tokens.extend(col_computed)
        running.num_new_blocks.extend(col_num_new)
        running.new_block_ids.extend(col_blocks)
    if out.spec_token_ids:
        drafts = step.drafts
        for req_id, tokens in out.spec_token_ids.items():
            drafts.handles.append(by_id[req_id])
            drafts.num_tokens.append(len(tokens))
            drafts.token_ids.extend(tokens)
    for dev, host in out.blocks_to_swap_out:
        step.swap_out.add(device_block=dev, host_block=host)
    for dev, host in out.blocks_to_swap_in:
        step.swap_in.add(device_block=dev, host_block=host)
    if release:
        handles.release_handles(step.finished)
    return step


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def decode_step_result(
    result: worker_link_pb2.StepResult,
    handles: HandleTable,
    vocab_size: int | None = None,
    drafts: dict[str, list[int]] | None = None,
) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
    """Sampled tokens (and logprobs) by request id. With `vocab_size`, checks that each
    request got at most one token (1 + its drafts' count, for a request in `drafts`), below
    it, and that logprobs' top ids are below it too (ValueError otherwise): an impossible id
    must not reach a client's detokenizer, nor another worker's embedding once its request
    moves."""
    sampled: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    by_handle = handles.by_handle
    vocab = vocab_size
    if result.sampled_handles:
        _decode_sampled_columns(result, by_handle, vocab, sampled)
    for item in result.sampled:
        req_id = by_handle.get(item.handle)
        if req_id is None:
            raise ValueError(f"worker answered for unknown request handle {item.handle}")
        tokens = item.token_ids
        if len(tokens) == 1:
            tok = tokens[0]
            if vocab is not None and not 0 <= tok < vocab:
                raise ValueError(_bad_tokens(req_id, [tok], vocab))
            sampled[req_id] = [tok]
        else:
            if vocab is not None and tokens:
                most = 1 + len(drafts.get(req_id, ())) if drafts else 1
                if len(tokens) > most or max(tokens) >= vocab:
                    raise ValueError(_bad_tokens(req_id, list(tokens), vocab))
            sampled[req_id] = list(tokens)
        if item.logprobs:
            logprobs[req_id] = _decode_logprobs(req_id, item, vocab)
    return sampled, logprobs


def _decode_logprobs(
    req_id: str, item: worker_link_pb2.SampledTokens, vocab: int | None
) -> list[TokenLogprobs]:
    """One logprob and n top (id, logprob) pairs per sampled token; ValueError when the
    columns disagree or a top id is outside the vocabulary."""
    count = len(item.token_ids)
    top_ids = item.top_token_ids
    n = len(top_ids) // max(count, 1)
    shape = (len(item.logprobs), len(item.top_logprobs), len(top_ids))
    if shape != (count, n * count, n * count):
        raise ValueError(
            f"worker answered logprobs of the wrong shape for request {req_id}: "
            f"{len(item.logprobs)} logprobs, {len(top_ids)} top ids and "
            f"{len(item.top_logprobs)} top logprobs for {count} tokens"
        )
    if vocab is not None and top_ids and max(top_ids) >= vocab:
        raise ValueError(
            f"worker answered top logprob id {max(top_ids)} for request {req_id}: ids below "
            f"the vocabulary size {vocab} were expected"
        )
    return [
        TokenLogprobs(
            tok,
            item.logprobs[i],
            list(
                zip(
                    top_ids[i * n : (i + 1) * n],
                    item.top_logprobs[i * n : (i + 1) * n],
                    strict=True,
                )
            ),
        )
        for i, tok in enumerate(item.token_ids)
    ]


def _decode_sampled_columns(
    result: worker_link_pb2.StepResult,
    by_handle: dict[int, str],
    vocab: int | None,
    sampled: dict[str, list[int]],
) -> None:
    col_handles = list(result.sampled_handles)
    tokens = list(result.sampled_token_ids)
    if len(col_handles) != len(tokens):
        raise ValueError(f"{len(col_handles)} sampled handles but {len(tokens)} sampled tokens")
    try:
        req_ids = list(map(by_handle.__getitem__, col_handles))
    except KeyError as exc:
        raise ValueError(f"worker answered for unknown request handle {exc.args[0]}") from None
    if vocab is not None and max(tokens) >= vocab:
        bad = next(i for i, t in enumerate(tokens) if t >= vocab)
        raise ValueError(_bad_tokens(req_ids[bad], [tokens[bad]], vocab))
    sampled.update(zip(req_ids, [[t] for t in tokens], strict=True))


def _bad_tokens(req_id: str, tokens: list[int], vocab: int) -> str:
    return (
        f"worker answered {tokens[:4]} for request {req_id}: at most one token below the "
        f"vocabulary size {vocab} was expected"
    )


def decode_step(step: worker_link_pb2.Step) -> SchedulerOutput:
    """On the worker: a Step as the core's SchedulerOutput, request ids being str(handle) (the
    real ids travel in NewRequest.request_id; the link keeps them, see worker_svc/link.py)."""
    out = SchedulerOutput(step_id=step.step_id)
    sched = out.num_scheduled_tokens
    for new in step.new_requests:
        req_id = str(new.handle)
        params, _ = sampling_from_proto(new.sampling)
        out.new_requests.append(
            NewRequestData(
                request_id=req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=list(new.output_token_ids),
                lora_name=new.lora_name,
            )
        )
        if new.num_scheduled_tokens:
            sched[req_id] = new.num_scheduled_tokens
    append_cached = out.cached_requests.append
    running = step.running
    if running.handles:
        _decode_running(running, append_cached, sched)
    for cached in step.cached_requests:
        req_id = str(cached.handle)
        blocks = cached.new_block_ids
        resumed = cached.resumed
        append_cached(
            CachedRequestData(
                req_id,
                list(blocks) if blocks else [],
                cached.num_computed_tokens,
                resumed,
                list(cached.new_token_ids) if resumed else [],  # only a resumed one has them
            )
        )
        n = cached.num_scheduled_tokens
        if n:
            sched[req_id] = n
    out.total_num_scheduled_tokens = sum(sched.values())
    out.preempted_req_ids = {str(h) for h in step.preempted}
    out.finished_req_ids = {str(h) for h in step.finished}
    out.blocks_to_swap_out = [(p.device_block, p.host_block) for p in step.swap_out]
    out.blocks_to_swap_in = [(p.device_block, p.host_block) for p in step.swap_in]
    drafts = step.drafts
    if drafts.handles:
        counts = list(drafts.num_tokens)
        tokens = list(drafts.token_ids)
        if len(counts) != len(drafts.handles) or sum(counts) != len(tokens):
            raise ValueError(
                f"drafts of unequal length: {len(drafts.handles)} handles, {len(counts)} "
                f"counts for {len(tokens)} tokens"
            )
        pos = 0
        for handle, k in zip(drafts.handles, counts, strict=True):
            out.spec_token_ids[str(handle)] = tokens[pos : pos + k]
            pos += k
    return out


def _decode_running(running: worker_link_pb2.RunningColumns, append_cached, sched) -> None:
    """The running columns as CachedRequestData; ValueError when the columns disagree."""
    ids = list(map(str, running.handles))
    scheduled = list(running.num_scheduled_tokens)
    computed = list(running.num_computed_tokens)
    num_new = list(running.num_new_blocks)
    blocks = list(running.new_block_ids)
    if not len(ids) == len(scheduled) == len(computed) == len(num_new) or sum(num_new) != len(
        blocks
    ):
        raise ValueError(
            f"running columns of unequal length: {len(ids)} handles, {len(scheduled)} "
            f"scheduled, {len(computed)} computed, {len(num_new)} block counts for "
            f"{len(blocks)} new blocks"
        )
    pos = 0
    for req_id, n, c, k in zip(ids, scheduled, computed, num_new, strict=True):
        if k:
            append_cached(CachedRequestData(req_id, blocks[pos : pos + k], c, False, []))
            pos += k
        else:
            append_cached(CachedRequestData(req_id, [], c, False, []))
        if n:
            sched[req_id] = n


def encode_step_result(
    step_id: int,
    sampled: dict[str, list[int]],
    logprobs: dict[str, list[TokenLogprobs]] | None = None,
    forward_time_s: float = 0.0,
    sample_time_s: float = 0.0,
    step_time_s: float = 0.0,
) -> worker_link_pb2.StepResult:
    result = worker_link_pb2.StepResult(
        step_id=step_id,
        forward_time_s=forward_time_s,
        sample_time_s=sample_time_s,
        step_time_s=step_time_s,
    )
    add = result.sampled.add
    col_handles: list[int] = []
    col_tokens: list[int] = []
    for req_id, tokens in sampled.items():  # per request per step: kept lean
        if len(tokens) == 1 and not (logprobs and req_id in logprobs):
            col_handles.append(int(req_id))
            col_tokens.append(tokens[0])
            continue
        item = add(handle=int(req_id), token_ids=tokens)
        if not logprobs:
            continue
        for lp in logprobs.get(req_id, ()):
            item.logprobs.append(lp.logprob)
            item.top_token_ids.extend(t for t, _ in lp.top)
            item.top_logprobs.extend(v for _, v in lp.top)
    if col_handles:
        result.sampled_handles.extend(col_handles)
        result.sampled_token_ids.extend(col_tokens)
    return result


FINISH_TO_PB = {
    None: generation_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generation_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: generation_pb2.FINISH_REASON_ERROR,
}
FINISH_FROM_PB = {value: reason for reason, value in FINISH_TO_PB.items()}
