"""Multi-LoRA serving on the worker: PEFT adapters read into host memory (adapter_file.py,
adapter_registry.py), placed in device slots (adapter_slots.py), and each step's rows running
their own adapter or none through one grouped low-rank product per site and layer (step_lora.py;
lora_ops.py in torch, native_lora.py over csrc/lora.c). The model adds the deltas at q/k/v,
o_proj, gate/up before the SiLU, and down_proj (worker_svc/model/llama.py)."""

from worker_svc.lora.adapter_file import BaseShapes, LoraInfo, LoraLoadError
from worker_svc.lora.adapters import LoraAdapters
from worker_svc.lora.step_lora import StepLora

__all__ = ["BaseShapes", "LoraAdapters", "LoraInfo", "LoraLoadError", "StepLora"]
