"""LoRA adapters served beside the base model (issue 31).

`request` is what users name an adapter with (no torch); `peft` reads an adapter
directory (its weights through `safetensors_file`); `layers` is the linear layer
with per-row adapters, and lays an adapter's matrices out as its slots hold them;
`adapters` keeps adapters so laid out on the host (an LRU of `max_cpu_loras`) and
`slots` on the device (`max_loras` slots); `kernel` runs the products; `model`
attaches all of it to a model and maps each step's rows to slots; `ranks` has the
other tensor-parallel ranks follow rank 0's adapters and slots.
"""

from asyncllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
