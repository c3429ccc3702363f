"""GGUF models (llama.cpp's format): finding a model's files and preparing the
Hugging Face-style folder (config, tokenizer, tensor table) the engine reads.
The weights themselves are loaded by `asyncllm.models.gguf`, kept quantized."""

from asyncllm.gguf_files.locate import gguf_files, names_gguf
from asyncllm.gguf_files.prepare import is_prepared, prepare_gguf, read_manifest

__all__ = ["gguf_files", "is_prepared", "names_gguf", "prepare_gguf", "read_manifest"]
