"""The two backends a benchmark sends its requests through: splitserve's gRPC Generation API
(token ids in, streamed token ids out) and any OpenAI-compatible HTTP server (streaming
/v1/completions with the prompt as token ids; plain httpx, no client-side retries)."""

from __future__ import annotations

import argparse
import json
import sys

from splitserve.loadgen.dataset import BenchRequest
from splitserve.loadgen.results import RequestResult, _Timer


class GrpcBackend:
    name = "grpc"

    def __init__(self, args: argparse.Namespace) -> None:
        import grpc

        from common.pb import generation_pb2_grpc

        self.grpc = grpc
        self.args = args
        self.channel = grpc.aio.insecure_channel(args.target)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None

    async def check(self) -> str:
        from common.pb import generation_pb2 as pb

        info = await self.stub.GetServerInfo(
            pb.ServerInfoRequest(), metadata=self.metadata, timeout=30
        )
        if not info.workers:
            print("warning: the server has no worker attached", file=sys.stderr)
        return self.args.model or info.model

    async def send(self, req: BenchRequest, t0: float) -> RequestResult:
        from common.client import build_request

        result = RequestResult(prompt_len=len(req.prompt_token_ids))
        msg = build_request(
            token_ids=req.prompt_token_ids,
            model=self.args.model or "",
            max_tokens=req.max_tokens,
            temperature=self.args.temperature,
            ignore_eos=self.args.ignore_eos or None,
        )
        timer = _Timer(result, t0)
        try:
            call = self.stub.Generate(msg, metadata=self.metadata, timeout=self.args.timeout)
            async for out in call:
                if out.token_ids:
                    timer.tokens(len(out.token_ids))
                if out.finish_reason:
                    result.output_len = out.completion_tokens
                    result.ok = not out.error
                    result.error = out.error
            timer.done()
            if not result.ok and not result.error:
                result.error = "the stream ended without a finish reason"
        except self.grpc.RpcError as exc:
            result.error = f"{exc.code().name}: {exc.details()}"
        return result

    async def close(self) -> None:
        await self.channel.close()


class OpenAIBackend:
    name = "openai"

    def __init__(self, args: argparse.Namespace) -> None:
        import httpx

        self.args = args
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.client = httpx.AsyncClient(
            base_url=args.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(args.timeout, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self.model = args.model

    async def check(self) -> str:
        if not self.model:
            r = await self.client.get("/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self.model

    async def send(self, req: BenchRequest, t0: float) -> RequestResult:
        import httpx

        result = RequestResult(prompt_len=len(req.prompt_token_ids))
        payload = {
            "model": self.model,
            "prompt": req.prompt_token_ids,
            "max_tokens": req.max_tokens,
            "temperature": self.args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.args.ignore_eos:
            payload["ignore_eos"] = True
        timer = _Timer(result, t0)
        chunks = 0
        try:
            async with self.client.stream("POST", "/completions", json=payload) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    result.error = f"HTTP {resp.status_code}: {body[:300]}"
                    return result
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        result.ok = not result.error
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = str(chunk["error"].get("message", chunk["error"]))
                        continue
                    if chunk.get("usage"):
                        result.output_len = chunk["usage"].get("completion_tokens", 0)
                    for choice in chunk.get("choices") or ():
                        if choice.get("text") or choice.get("finish_reason") is None:
                            timer.tokens(1)
                            chunks += 1
            timer.done()
            if not result.ok and not result.error:
                result.error = "the stream ended without data: [DONE]"
            if not result.output_len:  # a server without usage in streams
                result.output_len = chunks
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        return result

    async def close(self) -> None:
        await self.client.aclose()
