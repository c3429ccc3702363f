"""The flags the `asyncllm` subcommands share, and their conversion to config.

Every `EngineArgs` field is a flag (`--max-num-seqs`, `--enable-prefix-caching /
--no-enable-prefix-caching`, ...), generated from the dataclass so none can be
forgotten; `ENGINE_HELP` documents each (a test checks that all have help).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from asyncllm.config import EngineArgs
from asyncllm.config_rules import (
    DATA_PARALLEL_BACKENDS,
    DEVICES,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPES,
    EXECUTORS,
    KV_CACHE_DTYPES,
    OMP_WAIT_POLICIES,
    QUANTIZATIONS,
)
from asyncllm.default_model import DEFAULT_MODEL
from asyncllm.sampling_params import SamplingParams

ENGINE_HELP: dict[str, str] = {
    "tokenizer": "directory with tokenizer.json (default: the model directory)",
    "dtype": f"weights and activations dtype, one of {', '.join(DTYPES)} (auto: the "
    "checkpoint's torch_dtype; float16 runs as bfloat16 on the CPU; a GGUF runs "
    "bfloat16 on a CPU with AVX512-BF16, else float32)",
    "kv_cache_dtype": f"KV cache dtype, one of {', '.join(KV_CACHE_DTYPES)} (auto: the "
    "model's dtype)",
    "quantization": f"quantize a float checkpoint's linear layers at load, one of"
    f" {', '.join(QUANTIZATIONS)} (round to nearest, a scale per 128 inputs for int8, 32"
    " for int4; weights stay integers in memory; default: the checkpoint as it is)",
    "device": f"where the model runs, one of {', '.join(DEVICES)}",
    "block_size": "tokens per KV-cache block (a power of two)",
    "kv_cache_memory_gib": "KV-cache size in GiB (exclusive with --num-kv-blocks)",
    "num_kv_blocks": "KV-cache size in blocks (exclusive with --kv-cache-memory-gib)",
    "max_num_seqs": "most requests in one running batch",
    "max_num_batched_tokens": "token budget of one engine step (chunked prefill)",
    "max_model_len": "context length (default: the model's)",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "seed": "seed of the engine's random state",
    "executor": f"model executor, one of {', '.join(EXECUTORS)} ('null' runs no model)",
    "null_step_delay_ms": "simulated step time of the null executor, in ms",
    "data_parallel_size": "engine cores behind one front end, each a whole engine (model copy,"
    " KV cache, scheduler); requests go to the least-loaded",
    "data_parallel_backend": "where the engine cores run: 'mp', child processes here;"
    " 'ray', Ray actors across the nodes of a Ray cluster (pip install 'asyncllm[ray]')",
    "data_parallel_address": "with --data-parallel-backend ray: the address to listen on"
    " for the cores (default: this node's IP as Ray reports it; never all interfaces)",
    "tensor_parallel_size": "shard the model over this many processes of each engine core"
    " (Llama, Mistral, Qwen2; gloo on the CPU, NCCL on CUDA); each rank runs --num-threads"
    " threads, by default the CPUs shared out among the ranks",
    "distributed_executor_backend": "where tensor-parallel ranks 1..N-1 run: 'mp', worker"
    " processes on the core's machine; 'ray', Ray actors in a placement group over the nodes"
    " of a Ray cluster (pip install 'asyncllm[ray]'; ignored with --tensor-parallel-size 1)",
    "num_threads": "torch threads of each engine core (default: serve: all CPUs but one;"
    " generate: one per physical core; shared out among data-parallel cores)",
    "compile": "fuse the elementwise work between the matmuls with torch.compile (inductor);"
    " the first start compiles (README: cold and warm start-up), later ones reuse the"
    " kernels cached under $XDG_CACHE_HOME/asyncllm/inductor (off by default)",
    "linear_kernel": "CPU kernel of the linear layers: auto (measure F.linear, torch's"
    " prepacked oneDNN linear and the rust matrix-vector kernel per shape at load, cached"
    " on disk), torch, onednn or rust (default: $ASYNCLLM_LINEAR_KERNEL, else auto)",
    "batch_invariant": "a request's output does not depend on the requests beside it:"
    " every linear layer on the rust kernel (one reduction order for any row count), prompt"
    " tokens attending one by one on the decode kernel (default: $ASYNCLLM_BATCH_INVARIANT,"
    " else off)",
    "fused_decode": "run small all-decode steps of Llama-shaped models (every decoder layer)"
    " in one extension call (on by default; off with --batch-invariant or --compile)",
    "cpu_bind": "override the thread placement: auto (the policy), nobind (pin nothing),"
    " or a CPU list such as 2-7 for the engine core (default:"
    " $ASYNCLLM_CPU_OMP_THREADS_BIND, else auto)",
    "pin_threads": "pin the engine core's threads to the last --num-threads CPUs and the"
    " front end to the others (default: $ASYNCLLM_PIN_THREADS, else on for serve when"
    " that leaves the front end a CPU, off for generate)",
    "omp_wait_policy": f"OpenMP wait policy of the engine core's torch threads, one of"
    f" {', '.join(OMP_WAIT_POLICIES)} (inherit: this environment's OMP_WAIT_POLICY;"
    " auto: inherit for generate, else passive; default: $ASYNCLLM_OMP_WAIT_POLICY,"
    " else auto)",
    "prefix_aware_routing": "with --data-parallel-size: send a prompt whose first KV block"
    " was seen before to the same core, unless it is much busier (off by default)",
    "async_scheduling": "overlap scheduling: prepare step N+1 while step N's forward runs"
    " (default: on for CUDA, off on the CPU)",
    "trace_dir": "write a Chrome trace-event timeline of every step, from the engine core "
    "and the front end, into this directory (Perfetto opens it; default: "
    "$ASYNCLLM_TRACE_DIR, else off)",
    "profile_dir": "enable torch profiling of the engine core (POST /start_profile and "
    "/stop_profile on the server); traces go to this directory",
    "speculative_config": "speculative decoding, as JSON with vLLM's names, e.g."
    ' \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,'
    ' "prompt_lookup_max": 5}\' (off by default; needs --no-async-scheduling or its default)',
    "collect_step_timings": "keep the engine core's per-step timers for get_step_timings "
    "(benchmarks)",
    "enable_lora": "serve LoRA adapters (PEFT format) beside the base model: a request picks"
    " one by name (serve: --lora-modules, the request's model field)",
    "max_loras": "most distinct LoRA adapters in one step (their device slots)",
    "max_lora_rank": "highest LoRA rank an adapter may have (the slots' width)",
    "max_cpu_loras": "LoRA adapters kept loaded on the host, least recently used evicted"
    " (default: --max-loras)",
}
_CHOICES = {
    "dtype": DTYPES,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "device": DEVICES,
    "executor": EXECUTORS,
    "data_parallel_backend": DATA_PARALLEL_BACKENDS,
    "distributed_executor_backend": DISTRIBUTED_EXECUTOR_BACKENDS,
    "omp_wait_policy": OMP_WAIT_POLICIES,
    "quantization": QUANTIZATIONS,
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """MODEL and one flag per `EngineArgs` field."""
    parser.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"local Hugging Face model directory (default: {DEFAULT_MODEL}, the built-in model)",
    )
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = ENGINE_HELP.get(f.name, f"EngineArgs.{f.name}")
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        type_name = str(f.type)
        if type_name.startswith("bool"):
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        kind: Any = str
        if type_name.startswith("int"):
            kind = int
        elif type_name.startswith("float"):
            kind = float
        group.add_argument(
            flag,
            type=kind,
            default=default,
            choices=_CHOICES.get(f.name),
            help=f"{help_text} (default: {default})",
        )


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The EngineArgs the parsed engine flags name (validated by EngineArgs)."""
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    return EngineArgs.from_kwargs(**{name: getattr(ns, name) for name in names})


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig limit (`--max-n` for `max_n`), from LIMIT_HELP."""
    from asyncllm.server.config import LIMIT_HELP, limit_fields

    g = parser.add_argument_group("limits (every size a client controls is bounded)")
    for name, kind, default in limit_fields():
        g.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=default,
            help=f"{LIMIT_HELP[name]} (default: {default})",
        )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """`generate`'s sampling flags, each with its SamplingParams default."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    g.add_argument("--temperature", type=float, default=1.0, help="0 means greedy (default: 1)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k best (0: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="minimum relative probability")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")


def sampling_params_from(ns: argparse.Namespace, **extra: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        seed=ns.sampling_seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
        **extra,
    )


_SAMPLING_FLAGS = (
    ("temperature", float, "sampling temperature (0 = greedy)"),
    ("top_p", float, "nucleus sampling mass"),
    ("top_k", int, "sample among the k most likely tokens"),
    ("min_p", float, "minimum probability relative to the most likely token"),
)


def add_optional_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (unset: the server's or SamplingParams' defaults)")
    for name, kind, text in _SAMPLING_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)


def optional_sampling_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The sampling parameters the user gave, and only those."""
    return {
        name: getattr(ns, name)
        for name, _, _ in _SAMPLING_FLAGS
        if getattr(ns, name, None) is not None
    }
