"""Every environment variable asyncllm reads, in one place, typed and checked."""

from __future__ import annotations

import os

from asyncllm.errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"environment variable {name}={raw!r} is invalid: must be 1/0/true/false")


def multiprocess() -> bool:
    """ASYNCLLM_MULTIPROCESS (default 1): run the engine core in its own process.
    0 keeps it in the caller's process, for debugging."""
    return _bool("ASYNCLLM_MULTIPROCESS", True)


def async_scheduling() -> bool | None:
    """ASYNCLLM_ASYNC_SCHEDULING (unset: auto): the default of
    `EngineArgs.async_scheduling` (overlap scheduling), so that a deployment or a
    whole test suite can run in either mode without code changes."""
    if not os.environ.get("ASYNCLLM_ASYNC_SCHEDULING"):
        return None
    return _bool("ASYNCLLM_ASYNC_SCHEDULING", False)


def log_level() -> str:
    """ASYNCLLM_LOG_LEVEL (default WARNING): the engine-core process's log level."""
    value = os.environ.get("ASYNCLLM_LOG_LEVEL", "WARNING").upper()
    if value not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise ConfigError(
            f"environment variable ASYNCLLM_LOG_LEVEL={value!r} is invalid: must be one of "
            "DEBUG, INFO, WARNING, ERROR, CRITICAL"
        )
    return value


def api_key() -> str | None:
    """ASYNCLLM_API_KEY (default unset): the key `asyncllm serve` requires when
    --api-key is not given; read from the environment so that it does not show
    in the process list."""
    value = os.environ.get("ASYNCLLM_API_KEY", "")
    return value or None


def trace_dir() -> str | None:
    """ASYNCLLM_TRACE_DIR (default unset): write a Chrome trace-event timeline of
    every step from the engine core and the front end into this directory (see
    asyncllm.tracing); the same as EngineArgs.trace_dir / --trace-dir."""
    value = os.environ.get("ASYNCLLM_TRACE_DIR", "")
    return value or None


def pin_threads() -> bool | None:
    """ASYNCLLM_PIN_THREADS (unset: auto): the default of `EngineArgs.pin_threads`."""
    if not os.environ.get("ASYNCLLM_PIN_THREADS"):
        return None
    return _bool("ASYNCLLM_PIN_THREADS", False)


def omp_wait_policy() -> str:
    """ASYNCLLM_OMP_WAIT_POLICY (default "auto": the placement policy's choice): the
    default of `EngineArgs.omp_wait_policy` (checked there)."""
    return os.environ.get("ASYNCLLM_OMP_WAIT_POLICY", "").strip().lower() or "auto"


def host_ip() -> str | None:
    """ASYNCLLM_HOST_IP (default unset: the address Ray gives this node): the
    address rank 0 of a tensor-parallel group over Ray binds its rendezvous socket
    to and the interface gloo's sockets use (vLLM's VLLM_HOST_IP). Checked where it
    is used: it must be an address of that machine."""
    return os.environ.get("ASYNCLLM_HOST_IP", "").strip() or None


def linear_kernel() -> str:
    """ASYNCLLM_LINEAR_KERNEL (default "auto"): the default of
    `EngineArgs.linear_kernel` (checked there)."""
    return os.environ.get("ASYNCLLM_LINEAR_KERNEL", "").strip().lower() or "auto"


def lora_kernel() -> str:
    """ASYNCLLM_LORA_KERNEL (default "auto"): the LoRA shrink/expand of every adapted
    layer, "rust", "torch" or "auto" (rust on the CPU; asyncllm.lora.kernel.choose,
    which checks it)."""
    return os.environ.get("ASYNCLLM_LORA_KERNEL", "").strip().lower() or "auto"


def gguf_kernel() -> str:
    """ASYNCLLM_GGUF_KERNEL (default "auto"): the kernel of every GGUF linear layer
    at every row count, "int", "float" (the float-activation reference), "tiles" or
    "tiles_bf16" (asyncllm.models.gguf.layers), or "auto" (measured at load).
    Checked by asyncllm.worker.gguf_select."""
    return os.environ.get("ASYNCLLM_GGUF_KERNEL", "").strip().lower() or "auto"


def quant_kernel() -> str:
    """ASYNCLLM_QUANT_KERNEL (default "auto"): "auto" runs the int8 and int4
    checkpoint layers that have an exact GGUF form on the GGUF kernels (on the
    CPU, asyncllm.models.quant.as_gguf); "reference" keeps every one on its
    checked reference path (`QuantLinear`). Checked by the model runner."""
    return os.environ.get("ASYNCLLM_QUANT_KERNEL", "").strip().lower() or "auto"


def batch_invariant() -> bool:
    """ASYNCLLM_BATCH_INVARIANT (default off; vLLM's VLLM_BATCH_INVARIANT): the
    default of `EngineArgs.batch_invariant`."""
    return _bool("ASYNCLLM_BATCH_INVARIANT", False)


def cpu_bind() -> str:
    """ASYNCLLM_CPU_OMP_THREADS_BIND (default "auto"; vLLM's VLLM_CPU_OMP_THREADS_BIND):
    the default of `EngineArgs.cpu_bind` (checked there)."""
    return os.environ.get("ASYNCLLM_CPU_OMP_THREADS_BIND", "").strip() or "auto"


def grammar_compile_deadline_s() -> float:
    """ASYNCLLM_GRAMMAR_COMPILE_DEADLINE_S (default 10): how long a request waits
    for its grammar to compile before it fails with a 400. Longer on a machine
    whose compile threads (lowest priority) get little CPU."""
    raw = os.environ.get("ASYNCLLM_GRAMMAR_COMPILE_DEADLINE_S", "").strip()
    if not raw:
        return 10.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise ConfigError(
            f"environment variable ASYNCLLM_GRAMMAR_COMPILE_DEADLINE_S={raw!r} is invalid: "
            "must be seconds in (0, 3600]"
        )
    return value
