"""Engine configuration: `EngineArgs` as the user writes it, validated field by field.

Values that need the model (its context length, its dtype) are resolved when the
engine starts, by `EngineArgs.resolve`, into a frozen `EngineConfig`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncllm import envs
from asyncllm.config_rules import (
    DTYPES,
    check_fields,
    parse_cpu_list,
)
from asyncllm.config_rules import fail as _fail
from asyncllm.default_model import DEFAULT_MODEL, resolve_model
from asyncllm.errors import ConfigError
from asyncllm.spec_config import SpeculativeConfig, check_draft_vocab

if TYPE_CHECKING:
    import torch

_DEFAULT_CPU_KV_GIB = 1.0
_DEFAULT_CUDA_KV_FRACTION = 0.8

logger = logging.getLogger(__name__)


@dataclass
class EngineArgs:
    """Everything that shapes an engine. Field names follow vLLM's `EngineArgs`.

    `model` is a local Hugging Face directory; the default, `asyncllm-tiny`, is the
    small model shipped inside the package (see `asyncllm.default_model`)."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    # "auto": the checkpoint's torch_dtype, except float16 runs as bfloat16 on the CPU,
    # and a GGUF runs bfloat16 on a CPU with AVX512-BF16 (else float32)
    dtype: str = "auto"
    # The KV cache's dtype; "auto" = the model's (float16 models keep float16 on CUDA)
    kv_cache_dtype: str = "auto"
    # vLLM's --quantization: "int8" or "int4" quantizes a float checkpoint's linear
    # layers at load (round to nearest, per-group scales; models/quant). None: the
    # checkpoint as it is (GGUF and compressed-tensors checkpoints stay quantized).
    quantization: str | None = None
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory_gib: float | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    # "torch" runs the model; "null" samples without one, for measuring the engine
    # around the model (see asyncllm.worker.null_runner).
    executor: str = "torch"
    null_step_delay_ms: float = 0.0
    # Overlap scheduling: schedule step N+1 and hand off step N-1 while step N's
    # forward pass runs on a runner thread (see asyncllm.engine.overlap). Default:
    # ASYNCLLM_ASYNC_SCHEDULING, else None: on for CUDA, off on the CPU, where the
    # runner thread's torch ops and the busy loop share the same cores and the
    # measured gain is not there (README).
    async_scheduling: bool | None = field(default_factory=envs.async_scheduling)
    # Observability (asyncllm.tracing): a Chrome trace of every step from both
    # processes (default: $ASYNCLLM_TRACE_DIR, else off); the directory torch
    # profiles go to, which enables the core's start_profile/stop_profile; and the
    # core's per-step timers that the benchmarks read through get_step_timings.
    trace_dir: str | None = None
    profile_dir: str | None = None
    collect_step_timings: bool = False
    # Data parallelism: this many engine cores (each a whole engine with its own
    # scheduler, KV cache and model copy) behind one front end (frontend/dp_client.py).
    data_parallel_size: int = 1
    # With data parallelism: a prompt whose first KV block was routed before goes
    # to the same core (its prefix cache may hold it) unless that core is busier
    # than the least-loaded one by more than a small margin.
    prefix_aware_routing: bool = False
    # Where data-parallel cores run: "mp", child processes on this machine over ipc
    # sockets; "ray", Ray actors spread over a Ray cluster's nodes, reaching this
    # process over TCP secured with CURVE (engine/ray_launcher.py, curve.py).
    data_parallel_backend: str = "mp"
    # With "ray": the address this process listens on for the cores, never all
    # interfaces by default (None: this node's IP as Ray reports it).
    data_parallel_address: str | None = None
    # Tensor parallelism: the model's layers sharded over this many processes of
    # one engine core (rank 0 in the core, the others workers it starts; asyncllm.
    # executor), torch.distributed with gloo on the CPU, NCCL on CUDA.
    tensor_parallel_size: int = 1
    # Where ranks 1..N-1 run (vLLM's name): "mp", worker processes the core starts
    # on its machine; "ray", Ray actors in a placement group over a Ray cluster's
    # nodes, each starting the same worker process (executor/ray_executor.py). With
    # tensor_parallel_size 1 there is nothing to place and "ray" changes nothing.
    distributed_executor_backend: str = "mp"
    # torch's threads in the engine core (the model and the sampler kernel). None:
    # torch's default (one per physical core), shared out among data-parallel cores;
    # `asyncllm serve` and `AsyncLLM` make it all CPUs but one (asyncllm.placement).
    num_threads: int | None = None
    # Fused layers: torch.compile (inductor) the elementwise work between the
    # matmuls (asyncllm.worker.compile); kernels are cached on disk across runs.
    compile: bool = False
    # The CPU kernel of the linear layers (asyncllm.worker.linear_select): "auto"
    # measures torch's F.linear, torch's prepacked oneDNN linear and the rust
    # matrix-vector kernel per weight shape and row-count bucket when the model
    # loads (cached on disk) and runs the fastest; "torch", "onednn" or "rust"
    # force one. Default: ASYNCLLM_LINEAR_KERNEL. CUDA always runs F.linear.
    linear_kernel: str = field(default_factory=envs.linear_kernel)
    # Batch invariance (vLLM's VLLM_BATCH_INVARIANT): every linear layer runs the
    # rust kernel, whose result for a row is the same whatever rows share its step,
    # and prompt tokens attend one by one on the decode kernel, so a request's
    # logits do not depend on the batch or on its prompt's chunks (slower prefill).
    # Default: ASYNCLLM_BATCH_INVARIANT.
    batch_invariant: bool = field(default_factory=envs.batch_invariant)
    # Small all-decode steps of Llama-shaped models run every decoder layer in one
    # extension call (asyncllm.models.fused_decode): the same numbers as the torch
    # path, without its ~20 small ops per layer. Off with batch_invariant (whose
    # guarantee is tested on the torch path) and compile.
    fused_decode: bool = True
    # Placement (engine/launcher.py; measured in benches/bench_threads.py, README):
    # pin the engine core's threads to the last `num_threads` CPUs and the front end
    # to the others (None: on for `asyncllm serve` where that leaves the front end a
    # CPU, see asyncllm.placement; off otherwise); and the OpenMP wait policy of
    # the core's torch threads ("passive": sleep at once, leaving the CPU to the
    # front end and IO threads; "active": spin; "inherit": the environment's
    # OMP_WAIT_POLICY, else libgomp's spin-then-sleep; "auto": the placement
    # policy's choice, passive where it places nothing). Defaults:
    # ASYNCLLM_PIN_THREADS, ASYNCLLM_OMP_WAIT_POLICY.
    pin_threads: bool | None = field(default_factory=envs.pin_threads)
    omp_wait_policy: str = field(default_factory=envs.omp_wait_policy)
    # Overrides the placement policy (asyncllm.placement; vLLM's
    # VLLM_CPU_OMP_THREADS_BIND): "auto" applies it, "nobind" pins nothing, a CPU
    # list ("2-7", "0,2,4-5") runs the core on exactly those CPUs. Default:
    # ASYNCLLM_CPU_OMP_THREADS_BIND.
    cpu_bind: str = field(default_factory=envs.cpu_bind)
    # Speculative decoding (vLLM's `speculative_config`; asyncllm.spec_config): a
    # dict such as {"method": "ngram", "num_speculative_tokens": 4}, or its JSON
    # text; None: off. Needs overlap scheduling off (None turns it off) and one
    # tensor-parallel rank.
    speculative_config: dict[str, Any] | str | None = None
    # LoRA adapters (vLLM's names; asyncllm.lora): serve requests that name an
    # adapter (`LoRARequest`) beside base-model requests in one batch. `max_loras`
    # adapters fit in a step (their weights sit in that many device slots),
    # `max_cpu_loras` stay loaded on the host (LRU; default max_loras), and no
    # adapter may have a rank above `max_lora_rank` (the slots' width).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str | Path) or not str(self.model):
            raise _fail(
                "model",
                self.model,
                f"the path of a local Hugging Face model directory or {DEFAULT_MODEL!r}",
            )
        self.model = resolve_model(str(self.model))
        if self.trace_dir is None:
            self.trace_dir = envs.trace_dir()
        check_fields(self)  # each field's own constraint (asyncllm.config_rules)
        for name in ("tokenizer", "trace_dir", "profile_dir"):
            if getattr(self, name) is not None:
                setattr(self, name, str(getattr(self, name)))
        # the constraints between fields
        if self.num_kv_blocks is not None and self.kv_cache_memory_gib is not None:
            raise ConfigError(
                "EngineArgs.num_kv_blocks and EngineArgs.kv_cache_memory_gib are exclusive: "
                "give the KV-cache size one way"
            )
        if self.tensor_parallel_size > 1 and self.executor == "null":
            raise _fail("tensor_parallel_size", self.tensor_parallel_size, "1 with executor='null'")
        if self.pin_threads and self.data_parallel_size > 1:
            raise _fail("pin_threads", self.pin_threads, "False with data_parallel_size > 1")
        parse_cpu_list(self.cpu_bind)
        spec = SpeculativeConfig.parse(self.speculative_config)
        self.speculative_config = None if spec is None else spec.to_dict()
        if spec is not None:
            _check_speculative(self, spec)
        if self.enable_lora:
            _check_lora(self)

    def to_json(self) -> str:
        """The arguments as JSON: how they reach the engine-core process (no pickle)."""
        import json

        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_json(cls, text: str) -> EngineArgs:
        import json

        return cls.from_kwargs(**json.loads(text))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments, naming any unknown one."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(
                f"unknown engine argument(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**kwargs)

    def resolve(self, hf_config: Any) -> EngineConfig:
        """Resolve model-dependent values against the model's Hugging Face config.
        torch is imported only to look for CUDA, and not at all for the null
        executor, which runs no model (so its engine core starts fast)."""
        model_max = _model_context_len(hf_config)
        max_model_len = self.max_model_len or model_max
        if max_model_len is None:
            raise ConfigError(
                "EngineArgs.max_model_len is required: the model config gives no context length"
            )
        if model_max is not None and max_model_len > model_max:
            raise _fail("max_model_len", self.max_model_len, f"<= the model's context {model_max}")
        device = self.device
        if self.executor == "null":
            device = "cpu"
        elif device != "cpu":
            import torch

            if not torch.cuda.is_available():
                if device == "cuda":
                    raise _fail("device", self.device, "'cpu' or 'auto': CUDA is not available")
                device = "cpu"
            else:
                device = "cuda"
        dtype_name = _resolve_dtype(self.dtype, hf_config, device, gguf=_is_gguf(self.model))
        kv_dtype = dtype_name if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        spec = SpeculativeConfig.parse(self.speculative_config)
        kv_gib = self.kv_cache_memory_gib
        if kv_gib is None and self.num_kv_blocks is None and device == "cpu":
            kv_gib = _DEFAULT_CPU_KV_GIB
        return EngineConfig(
            model=self.model,
            tokenizer=self.tokenizer or self.model,
            dtype=dtype_name,
            kv_cache_dtype=kv_dtype,
            quantization=self.quantization,
            device=device,
            block_size=self.block_size,
            kv_cache_memory_gib=kv_gib,
            num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
            cuda_kv_fraction=_DEFAULT_CUDA_KV_FRACTION,
            executor=self.executor,
            null_step_delay_ms=float(self.null_step_delay_ms),
            async_scheduling=(
                device == "cuda" and spec is None
                if self.async_scheduling is None
                else self.async_scheduling
            ),
            trace_dir=self.trace_dir,
            profile_dir=self.profile_dir,
            collect_step_timings=self.collect_step_timings,
            num_threads=self.num_threads,
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            compile=self.compile,
            linear_kernel=self.linear_kernel,
            batch_invariant=self.batch_invariant,
            fused_decode=self.fused_decode and not self.batch_invariant and not self.compile,
            speculative=spec,
            lora=LoRAConfig.of(self) if self.enable_lora else None,
        )


@dataclass(frozen=True)
class EngineConfig:
    """The resolved, immutable configuration the engine core runs with."""

    model: str
    tokenizer: str
    dtype: str  # float32, bfloat16 or float16
    kv_cache_dtype: str  # float32, bfloat16 or float16 (the model's, on CUDA only)
    quantization: str | None  # int8, int4 or None (EngineArgs.quantization)
    device: str  # cpu or cuda
    block_size: int
    kv_cache_memory_gib: float | None
    num_kv_blocks: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    seed: int
    cuda_kv_fraction: float
    executor: str
    null_step_delay_ms: float
    async_scheduling: bool = False
    trace_dir: str | None = None
    profile_dir: str | None = None
    collect_step_timings: bool = False
    num_threads: int | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    compile: bool = False
    linear_kernel: str = "auto"
    batch_invariant: bool = False
    fused_decode: bool = True
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # None: enable_lora is off

    def to_json(self) -> str:
        """The config as JSON (the executors hand it to their tensor-parallel workers)."""
        import json

        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        """The config `to_json` wrote, its nested sections rebuilt."""
        import json

        fields = json.loads(text)
        if fields.get("speculative") is not None:
            fields["speculative"] = SpeculativeConfig(**fields["speculative"])
        if fields.get("lora") is not None:
            fields["lora"] = LoRAConfig(**fields["lora"])
        return cls(**fields)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    @property
    def torch_kv_cache_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.kv_cache_dtype)  # type: ignore[no-any-return]

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)


@dataclass(frozen=True)
class LoRAConfig:
    """The LoRA settings of an engine with `enable_lora` (see EngineArgs)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int

    @classmethod
    def of(cls, args: EngineArgs) -> LoRAConfig:
        cpu = args.max_loras if args.max_cpu_loras is None else args.max_cpu_loras
        return cls(args.max_loras, args.max_lora_rank, cpu)


def _check_lora(args: EngineArgs) -> None:
    """What LoRA serving does not run with yet: the fields that must change."""
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise _fail("max_cpu_loras", args.max_cpu_loras, f">= max_loras ({args.max_loras})")
    if args.executor == "null":
        raise _fail("executor", args.executor, "'torch' with enable_lora")


def _check_speculative(args: EngineArgs, spec: SpeculativeConfig) -> None:
    """What speculative decoding does not run with: the fields that must change."""
    if args.async_scheduling:
        raise _fail(
            "async_scheduling",
            args.async_scheduling,
            "False or None with speculative_config (verification needs each step's tokens "
            "before the next is planned)",
        )
    if args.tensor_parallel_size > 1:
        raise _fail("tensor_parallel_size", args.tensor_parallel_size, "1 with speculative_config")
    if args.executor == "null":
        raise _fail("executor", args.executor, "'torch' with speculative_config")
    if spec.model is not None:
        check_draft_vocab(args.tokenizer or args.model, spec.model)


def _model_context_len(hf_config: Any) -> int | None:
    """The longest context the model serves: its position limit. Sliding-window
    layers (Mistral, Gemma's local layers, Qwen2's use_sliding_window) attend within
    their window at any length (models/attention.py), so the window caps nothing."""
    length = None
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            length = value
            break
    return length


def _resolve_dtype(requested: str, hf_config: Any, device: str, gguf: bool = False) -> str:
    """The dtype the model runs in. "auto" takes the checkpoint's torch_dtype, except
    that float16 runs as bfloat16 on the CPU: the same range as float32, where CPU
    float16 matmuls are slow and overflow-prone; and that a GGUF model (whose blocks
    name no activation dtype) runs bfloat16 activations on a CPU with bf16 dot
    instructions, float32 elsewhere. One log line says what runs and why."""
    if requested != "auto":
        if requested == "float16" and device == "cpu":
            raise _fail("dtype", requested, "float32, bfloat16 or auto on the CPU")
        logger.info("dtype %s (EngineArgs.dtype)", requested)
        return requested
    if gguf and device == "cpu" and _cpu_has_bf16_dot():
        # SmolLM2 Q4_1 at 64 streams: 1.6x float32's tokens/s, held-out perplexity
        # within 0.05 % of the float reference (benches/RESULTS.md, bench_quant)
        logger.info(
            "dtype bfloat16 (dtype=auto: a GGUF model on a CPU with bf16 dot "
            "instructions; dtype=float32 keeps float32 activations)"
        )
        return "bfloat16"
    checkpoint = _config_dtype(hf_config)
    if checkpoint == "float16" and device == "cpu":
        logger.info(
            "dtype bfloat16 (dtype=auto: the checkpoint is float16, which runs as bfloat16 "
            "on the CPU)"
        )
        return "bfloat16"
    logger.info("dtype %s (dtype=auto: the checkpoint's torch_dtype)", checkpoint)
    return checkpoint


def _is_gguf(model: str) -> bool:
    """Whether `model` names GGUF files or the folder prepared from them (which
    `model` becomes before the config resolves)."""
    from asyncllm.gguf_files.locate import names_gguf
    from asyncllm.gguf_files.prepare import is_prepared

    return names_gguf(model) or is_prepared(model)


def _cpu_has_bf16_dot() -> bool:
    """Whether this CPU's kernels run bf16 on dot-product instructions (AVX512-BF16),
    within $ASYNCLLM_KERNEL_ISA's cap: without them bf16 steps convert in software."""
    from asyncllm import _core

    return _core._kernel_isa("bfloat16") == "avx512bf16"


def _config_dtype(hf_config: Any) -> str:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(value).removeprefix("torch.") if value is not None else "float32"
    return name if name in DTYPES else "float32"
