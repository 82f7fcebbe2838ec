"""Register a grpc.aio servicer whose unary requests are parsed by us, so that bytes that are
not a valid message get INVALID_ARGUMENT and a sentence (grpc's own parsing answers UNKNOWN)."""

from __future__ import annotations

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError


def _parser(cls):
    async def parse(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            return cls.FromString(raw)
        except DecodeError as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a valid {cls.DESCRIPTOR.full_name} message ({exc})",
            )

    return parse


def _unary_unary(fn, parse):
    async def handler(raw, context):
        return await fn(await parse(raw, context), context)

    return handler


def _unary_stream(fn, parse):
    async def handler(raw, context):
        async for item in fn(await parse(raw, context), context):
            yield item

    return handler


def add_servicer(servicer, server: grpc.aio.Server, service: ServiceDescriptor) -> None:
    handlers = {}
    for method in service.methods:
        fn = getattr(servicer, method.name)
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        parse = _parser(request_cls)
        serialize = response_cls.SerializeToString
        if method.client_streaming:
            raise ValueError(f"{method.full_name}: client streaming is not handled here")
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _unary_stream(fn, parse),
                request_deserializer=None,
                response_serializer=serialize,
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary_unary(fn, parse),
                request_deserializer=None,
                response_serializer=serialize,
            )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
