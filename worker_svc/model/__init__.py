"""The one model implementation the worker runs (the Llama family), over worker_svc.ops."""

from worker_svc.model.llama import CausalLM, DecoderLayer
from worker_svc.model.spec import ARCHITECTURES, ModelSpec, UnsupportedModel, spec_of

__all__ = ["ARCHITECTURES", "CausalLM", "DecoderLayer", "ModelSpec", "UnsupportedModel", "spec_of"]
