"""LoRA adapters served beside the base model (issue 31).

`request` is what users name an adapter with (no torch); `peft` reads an adapter
directory; `weights` lays its matrices out for our fused projections; `layers`
is the linear layer with per-row adapters; `slots` keeps adapters on the device
(`max_loras` slots) and on the host (an LRU of `max_cpu_loras`); `model` attaches
all of it to a model and maps each step's rows to slots.
"""

from asyncllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
