"""Python client for the Generation API."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc as pb_grpc
from common.pb import sampling_pb2
from common.tls import open_channel

FINISH_NAMES = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}

_SAMPLING_FIELDS = {f.name for f in sampling_pb2.SamplingParams.DESCRIPTOR.fields}


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    worker_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }


def build_request(
    prompt: str | None = None,
    *,
    token_ids: list[int] | None = None,
    messages: list[dict] | None = None,
    request_id: str = "",
    model: str = "",
    priority: int = 0,
    tenant: str = "",
    deadline_s: float = 0.0,
    n: int = 0,
    lora_name: str = "",
    **sampling,
) -> pb.GenerateRequest:
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    request = pb.GenerateRequest(
        request_id=request_id,
        model=model,
        priority=priority,
        tenant=tenant,
        deadline_s=deadline_s,
        n=n,
        lora_name=lora_name,
        sampling=sampling_pb2.SamplingParams(
            **{k: v for k, v in sampling.items() if v is not None}
        ),
    )
    if messages is not None:
        request.chat.messages.extend(pb.ChatMessage(**m) for m in messages)
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    elif prompt is not None:
        request.text = prompt
    return request


class SplitserveClient:
    def __init__(
        self,
        target: str = "localhost:50051",
        api_key: str | None = None,
        timeout: float | None = None,
        tls: bool = False,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls_server_name: str | None = None,
        own_connection: bool = False,
    ) -> None:
        use_tls = tls or bool(tls_ca_file or tls_cert_file)
        # gRPC shares one connection among a process's channels to one target; with
        # own_connection this client dials its own (front-ends sharing a port each get some)
        options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
        self.channel = open_channel(
            target, options, use_tls, tls_ca_file, tls_cert_file, tls_key_file, tls_server_name
        )
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
        self.timeout = timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SplitserveClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[pb.GenerateResponse]:
        """Yields GenerateResponse messages; cancel by closing the iterator."""
        call = self.stub.Generate(
            build_request(prompt, **kwargs), timeout=self.timeout, metadata=self.metadata
        )
        try:
            yield from call
        finally:
            call.cancel()

    def generate(self, prompt: str | None = None, n: int = 1, **kwargs) -> GenerationResult:
        """The first (for n = 1, the only) sample."""
        return self.generate_choices(prompt, n=n, **kwargs)[0]

    def generate_choices(
        self, prompt: str | None = None, n: int = 2, **kwargs
    ) -> list[GenerationResult]:
        """n samples of one prompt (computed once), in index order."""
        results = [
            GenerationResult(request_id="", text="", token_ids=[], finish_reason=None)
            for _ in range(n)
        ]
        texts: list[list[str]] = [[] for _ in range(n)]
        for msg in self.stream(prompt, n=n, **kwargs):
            result = results[msg.index]
            result.request_id = msg.request_id
            result.token_ids.extend(msg.token_ids)
            texts[msg.index].append(msg.text)
            result.prompt_tokens = msg.prompt_tokens
            result.completion_tokens = msg.completion_tokens
            if msg.worker_id and (not result.worker_ids or result.worker_ids[-1] != msg.worker_id):
                result.worker_ids.append(msg.worker_id)
            if msg.finish_reason:
                result.finish_reason = FINISH_NAMES[msg.finish_reason]
                result.stop_reason = msg.stop_reason
                result.error = msg.error
        for result, parts in zip(results, texts, strict=True):
            result.text = "".join(parts)
        return results

    def abort(self, request_id: str) -> None:
        self.stub.Abort(
            pb.AbortRequest(request_id=request_id), timeout=self.timeout, metadata=self.metadata
        )

    def server_info(self) -> pb.ServerInfo:
        return self.stub.GetServerInfo(
            pb.ServerInfoRequest(), timeout=self.timeout, metadata=self.metadata
        )

    def wait_for_workers(self, n: int = 1, timeout: float = 60.0) -> pb.ServerInfo:
        import time

        deadline = time.monotonic() + timeout
        while True:
            try:
                info = self.server_info()
                if len(info.workers) >= n:
                    return info
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {n} workers attached after {timeout:g} s")
            time.sleep(0.2)
