"""Issue 28's model target, the files: `bench_quant.py --parts llama1b`.

A random-weight Llama of TinyLlama's widths (benches/models.py's `llama1b`: hidden
2048, 16 layers, 32 heads, 8 KV heads, intermediate 5632, vocab 32000; 0.85 B
parameters, seed 0, init std 0.02) saved as a bf16 safetensors checkpoint with the
llama-2 tokenizer, and the same bf16 weights as three GGUF files:

  - Q8_0 by gguf-py, every matrix Q8_0 (as `convert_hf_to_gguf --outtype q8_0`);
  - Q4_0 by gguf-py, the embedding Q4_0 as llama-quantize leaves it, the output
    Q8_0 (llama-quantize would write Q6_K there, which gguf-py cannot quantize);
  - Q4_K_M by llama.cpp's quantizer (`llama_cpp.llama_model_quantize`, the
    baseline package) from an F16 GGUF that gguf-py writes and that is then removed.

The GGUFs are written as llama.cpp's converter writes a Llama: its tensor names,
q and k rows permuted for its rotary layout, norms in F32, the vocabulary of
`tokenizer.json` through gguf-py's `LlamaHfVocab` and `SpecialVocab` (with the
merges, so that transformers' GGUF tokenizer is the checkpoint's).

Everything goes under `$XDG_CACHE_HOME/asyncllm/bench-llama1b/` (3.6 GB at full
size, and the 1.7 GB F16 while Q4_K_M is made) and is reused: each file is written
under a temporary name and renamed when complete. On the 2-core EPYC writing them
took 2.5 min (bf16 53 s, Q8_0 16 s, Q4_0 11 s, Q4_K_M 73 s). `--quick` writes
`llama1b-quick` (hidden 256, 2 layers) instead.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import torch
from fetch_smollm2 import models_dir
from models import build_model

from asyncllm.gguf_files import prepare_gguf, read_manifest

FULL, QUICK = "llama1b", "llama1b-quick"
# issue 28: tokens/s / bf16's, at batch 1 and at many streams
TARGETS = {"Q8_0": (1.8, 1.0), "Q4_0": (3.0, 1.0), "Q4_K_M": (3.0, 1.0)}


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/asyncllm/bench-llama1b` (beside the fetched models)."""
    return models_dir().parent / "bench-llama1b"


def write_models(quick: bool) -> dict[str, Path]:
    """The model argument of each setup, bf16 first; files absent are written now,
    each with the time it took (Q4_K_M only where llama-cpp-python is installed)."""
    name = QUICK if quick else FULL
    root = cache_root()
    t0 = time.perf_counter()
    dense = build_model(name, root, dtype=torch.bfloat16)
    print(f"bf16 checkpoint {dense}: {time.perf_counter() - t0:.0f} s", flush=True)
    writers: dict[str, Callable[[Path], None]] = {
        "Q8_0": lambda out: write_gguf(dense, out, "Q8_0", "Q8_0", "Q8_0"),
        "Q4_0": lambda out: write_gguf(dense, out, "Q4_0", "Q4_0", "Q8_0"),
        "Q4_K_M": lambda out: write_q4_k_m(dense, out),
    }
    paths = {"bf16": dense}
    for qtype, write in writers.items():
        path = root / f"{name}-{qtype}.gguf"
        if not path.is_file() and qtype == "Q4_K_M" and find_spec("llama_cpp") is None:
            # a clean machine (CI) without the baseline extra still runs the others
            print(
                f"{path.name}: not written: llama.cpp's quantizer makes it, and "
                "llama-cpp-python (pip install 'asyncllm[bench]') is not installed",
                flush=True,
            )
            continue
        if not path.is_file():
            t0 = time.perf_counter()
            tmp = path.with_name(f".{path.name}.part")
            write(tmp)
            os.replace(tmp, path)
            print(f"{path.name}: written in {time.perf_counter() - t0:.0f} s", flush=True)
        paths[qtype] = path
    return paths


def describe(path: Path) -> str:
    """A GGUF's size and how many tensors of each type it holds (from the folder
    the engine prepares for it: no second parse of the metadata)."""
    types = Counter(t["type"] for t in read_manifest(prepare_gguf(path))["tensors"])
    counts = ", ".join(f"{n} {t}" for t, n in types.most_common())
    return f"{path.stat().st_size / 2**20:.0f} MiB ({counts})"


def write_gguf(dense: Path, out: Path, layers: str, embedding: str, output: str) -> None:
    """The checkpoint in `dense` as a llama GGUF: the decoder's matrices in type
    `layers`, the token embedding in `embedding`, the LM head in `output`, vectors
    in F32 (type names as gguf-py's GGMLQuantizationType spells them)."""
    import gguf
    from safetensors import safe_open

    config = json.loads((dense / "config.json").read_text())
    qtype = gguf.GGMLQuantizationType
    file_type = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "F16": "MOSTLY_F16"}[layers]
    writer = gguf.GGUFWriter(out, "llama")
    _write_metadata(writer, config, getattr(gguf.LlamaFileType, file_type))
    _write_vocab(writer, dense)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    kinds = {"token_embd.weight": embedding, "output.weight": output}
    with safe_open(dense / "model.safetensors", "pt") as f:
        for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            name = names.get_name(hf_name, try_suffixes=(".weight",))
            if name is None:
                raise ValueError(f"no GGUF name for {hf_name}")
            weight = f.get_tensor(hf_name).float().numpy()
            if hf_name.endswith("q_proj.weight"):
                weight = _permute(weight, config["num_attention_heads"])
            elif hf_name.endswith("k_proj.weight"):
                weight = _permute(weight, config["num_key_value_heads"])
            kind = qtype.F32 if weight.ndim == 1 else qtype[kinds.get(name, layers)]
            writer.add_tensor(name, gguf.quants.quantize(weight, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_q4_k_m(dense: Path, out: Path) -> None:
    """Q4_K_M by llama.cpp's quantizer from an F16 GGUF of the checkpoint."""
    import ctypes

    import llama_cpp

    f16 = out.with_name(out.name + ".f16")
    try:
        write_gguf(dense, f16, "F16", "F16", "F16")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = torch.get_num_threads()
        if llama_cpp.llama_model_quantize(
            str(f16).encode(), str(out).encode(), ctypes.byref(params)
        ):
            raise RuntimeError(f"llama_model_quantize failed on {f16}")
    finally:
        f16.unlink(missing_ok=True)


def _write_metadata(writer, config: dict, file_type: int) -> None:  # type: ignore[no-untyped-def]
    """The hyperparameters convert_hf_to_gguf writes for a Llama."""
    import gguf

    writer.add_name("random llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_vocab(writer, dense: Path) -> None:  # type: ignore[no-untyped-def]
    """convert_hf_to_gguf's `_set_vocab_llama_hf` (a sentencepiece vocabulary from
    tokenizer.json), plus the merges, which transformers reads back."""
    import gguf

    vocab = gguf.LlamaHfVocab(dense)
    tokens, scores, types = zip(*vocab.all_tokens(), strict=True)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(list(tokens))
    writer.add_token_scores(list(scores))
    writer.add_token_types(list(types))
    gguf.SpecialVocab(dense, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's `LlamaModel.permute` of q/k rows (asyncllm's GGUF loader
    undoes it)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, -1).swapaxes(1, 2).reshape(weight.shape)
