"""`--compile`: torch.compile the parts of each decoder layer that are pure tensor code.

The MLP (gate/up GEMMs, activation, product, down GEMM) and the RMS norms are compiled with
dynamic shapes, so one graph serves every packed batch length; inductor fuses their
elementwise chains (a norm is 6 eager ops, silu * up 2) and keeps MKL for the GEMMs. The
attention module stays eager: it calls the paged attention function (ctypes / Python control
flow), which would break the graph anyway. Compiling happens on the first step (tens of
seconds on two cores); recompiles are bounded by dynamic shapes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("splitserve.worker.compile")

COMPILED_SUFFIXES = ("MLP", "RMSNorm")


def compile_model(model: nn.Module) -> int:
    """Compile the MLP and RMSNorm modules of `model` in place; returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith(COMPILED_SUFFIXES):
            module.forward = torch.compile(module.forward, dynamic=True, fullgraph=True)
            count += 1
    log.info("compiled %d MLP / norm modules (dynamic shapes)", count)
    return count
