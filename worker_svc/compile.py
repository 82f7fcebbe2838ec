"""`--compile`: torch.compile the elementwise chains of each decoder layer.

On the CPU a decode step of a small model spends a large share of its time in short elementwise
ops (an RMS norm is six of them, the gated MLP's activation and product two more), each paying a
dispatch and an OpenMP fork/join. Inductor fuses each chain into one loop. Compiled, with
dynamic shapes so one graph serves every packed batch length:
- every *RMSNorm module's forward;
- in every gated *MLP (gate_proj / up_proj / down_proj / act_fn), `act(gate) * up`; the GEMMs
  stay eager (they are MKL / oneDNN calls either way, and the runner's linear replacements,
  e.g. oneDNN-packed bfloat16 weights, do not trace).
The attention module stays eager: the paged attention call (ctypes, Python control flow) would
break the graph anyway. The first steps compile (tens of seconds on two cores).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("splitserve.worker.compile")


def compile_model(model: nn.Module) -> int:
    """Compile the norms and gated-MLP products of `model` in place; returns how many modules."""
    count = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = _compiled_call(module)
            count += 1
        elif name.endswith("MLP") and all(
            hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")
        ):
            module.forward = _gated_mlp_forward(module)
            count += 1
    log.info("compiled the elementwise chains of %d norm / MLP modules", count)
    return count


@torch.compile(dynamic=True, fullgraph=True)
def _act_mul(act: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act(gate) * up


@torch.compile(dynamic=True, fullgraph=True)
def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(module).forward(module, x)


def _compiled_call(module: nn.Module):
    # through one compiled function taking the module as an argument: every norm of a class
    # shares one graph (its parameters are graph inputs), not one compile per instance
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _call(module, x)

    return forward


def _gated_mlp_forward(mlp: nn.Module):
    # one compiled function for every layer (the activation module is an argument, so layers
    # sharing an activation class share the graph instead of recompiling per closure)
    def forward(x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(_act_mul(mlp.act_fn, mlp.gate_proj(x), mlp.up_proj(x)))

    return forward
