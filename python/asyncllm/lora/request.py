"""`LoRARequest`: how a request names its adapter (vLLM's class and field names).

A leaf of the lora package: no torch, so the front end imports it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncllm.errors import InvalidRequestError

# Bounds on what a client may send (the names travel on the wire and into metrics).
MAX_LORA_NAME_LEN = 256
MAX_LORA_PATH_LEN = 4096
MAX_LORA_INT_ID = 2**31 - 1


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter: `lora_name` (what clients call it), `lora_int_id` (>= 1, unique
    per adapter in an engine: 0 is the base model) and `lora_path` (a PEFT
    directory: adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        check_lora_fields(self.lora_name, self.lora_int_id, self.lora_path)

    @staticmethod
    def wire_fields(lora: LoRARequest | None) -> tuple[int, str | None, str | None]:
        """(lora_int_id, lora_name, lora_path) of an EngineCoreRequest under `lora`
        ((0, None, None): the base model)."""
        if lora is None:
            return 0, None, None
        return lora.lora_int_id, lora.lora_name, lora.lora_path

    @property
    def cache_key(self) -> str:
        """What makes its prefix-cache blocks its own (with the file's identity:
        see `lora.peft.AdapterFiles.identity`)."""
        return f"{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}"


def check_lora_fields(name: object, int_id: object, path: object) -> None:
    """Raises InvalidRequestError naming the field and its limit."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME_LEN:
        raise InvalidRequestError(
            f"LoRARequest.lora_name={name!r:.80} is invalid: must be a string of 1 to "
            f"{MAX_LORA_NAME_LEN} characters"
        )
    if isinstance(int_id, bool) or not isinstance(int_id, int) or not 0 < int_id <= MAX_LORA_INT_ID:
        raise InvalidRequestError(
            f"LoRARequest.lora_int_id={int_id!r} is invalid: must be an integer in "
            f"[1, {MAX_LORA_INT_ID}] (0 is the base model)"
        )
    if not isinstance(path, str) or not 0 < len(path) <= MAX_LORA_PATH_LEN or "\0" in path:
        raise InvalidRequestError(
            f"LoRARequest.lora_path={path!r:.80} is invalid: must be a directory path of 1 "
            f"to {MAX_LORA_PATH_LEN} characters"
        )
