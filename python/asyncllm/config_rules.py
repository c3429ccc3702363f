"""`EngineArgs`' per-field constraints, declared as a table: each rule names its field,
what the value must be, and how to tell. `EngineArgs.__post_init__` checks them in
order and then the few constraints between fields; every error names the field, the
value and what is allowed (`ConfigError`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncllm.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
DEVICES = ("auto", "cpu", "cuda")
EXECUTORS = ("torch", "null")
DATA_PARALLEL_BACKENDS = ("mp", "ray")
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
OMP_WAIT_POLICIES = ("auto", "passive", "active", "inherit")
LINEAR_KERNELS = ("auto", "torch", "onednn", "rust")
QUANTIZATIONS = ("int8", "int4")
MAX_BLOCK_SIZE = 256
MAX_DATA_PARALLEL = 64
MAX_TENSOR_PARALLEL = 64
MAX_LORAS = 256  # adapters in one step (device slots)
MAX_LORA_RANK = 512
MAX_CPU_LORAS = 4096


def fail(name: str, value: object, allowed: str) -> ConfigError:
    return ConfigError(f"EngineArgs.{name}={value!r} is invalid: must be {allowed}")


@dataclass(frozen=True, slots=True)
class Rule:
    """One field's constraint: `check(value)` holds, else ConfigError saying the
    value must be `allowed`."""

    name: str
    check: Callable[[Any], bool]
    allowed: str


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def integer(name: str, low: int, high: int | None = None, *, optional: bool = False) -> Rule:
    allowed = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
    return Rule(
        name,
        lambda v: (
            (optional and v is None) or (_is_int(v) and v >= low and (high is None or v <= high))
        ),
        f"None or {allowed}" if optional else allowed,
    )


def one_of(name: str, choices: tuple[str, ...]) -> Rule:
    return Rule(name, lambda v: v in choices, f"one of {', '.join(choices)}")


def boolean(name: str, *, optional: bool = False) -> Rule:
    return Rule(
        name,
        lambda v: isinstance(v, bool) or (optional and v is None),
        "None (auto) or a bool" if optional else "a bool",
    )


def _path(v: object) -> bool:
    return v is None or (isinstance(v, str | Path) and bool(str(v)))


def _address(v: object) -> bool:
    return v is None or (
        isinstance(v, str) and 0 < len(v) <= 255 and v not in ("*", "0.0.0.0", "::")
    )


# Every field's own constraint, in the order `EngineArgs.__post_init__` checks them.
RULES: tuple[Rule, ...] = (
    Rule(
        "tokenizer",
        lambda v: v is None or isinstance(v, str | Path),
        "None or a local directory path",
    ),
    one_of("dtype", DTYPES),
    one_of("kv_cache_dtype", KV_CACHE_DTYPES),
    one_of("device", DEVICES),
    Rule(
        "quantization",
        lambda v: v is None or v in QUANTIZATIONS,
        f"None or one of {', '.join(QUANTIZATIONS)}",
    ),
    integer("block_size", 1, MAX_BLOCK_SIZE),
    Rule(
        "block_size",
        lambda v: not v & (v - 1),
        f"a power of two in [1, {MAX_BLOCK_SIZE}]",
    ),
    Rule(
        "kv_cache_memory_gib",
        lambda v: v is None or (_is_num(v) and 0 < v <= 4096),
        "None or in (0, 4096]",
    ),
    integer("num_kv_blocks", 1, optional=True),
    integer("max_num_seqs", 1, 65536),
    integer("max_num_batched_tokens", 1, 1 << 20),
    integer("max_model_len", 1, optional=True),
    boolean("enable_prefix_caching"),
    integer("seed", 0, 2**63 - 1),
    one_of("executor", EXECUTORS),
    Rule("null_step_delay_ms", lambda v: _is_num(v) and 0 <= v <= 60_000, "in [0, 60000]"),
    boolean("async_scheduling", optional=True),
    Rule("trace_dir", _path, "None or a directory path"),
    Rule("profile_dir", _path, "None or a directory path"),
    boolean("collect_step_timings"),
    integer("data_parallel_size", 1, MAX_DATA_PARALLEL),
    integer("tensor_parallel_size", 1, MAX_TENSOR_PARALLEL),
    one_of("distributed_executor_backend", DISTRIBUTED_EXECUTOR_BACKENDS),
    integer("num_threads", 1, 1024, optional=True),
    boolean("compile"),
    Rule("cpu_bind", lambda v: isinstance(v, str), "a string"),
    Rule("linear_kernel", lambda v: v in LINEAR_KERNELS, " or ".join(map(repr, LINEAR_KERNELS))),
    boolean("batch_invariant"),
    boolean("pin_threads", optional=True),
    one_of("omp_wait_policy", OMP_WAIT_POLICIES),
    boolean("prefix_aware_routing"),
    boolean("enable_lora"),
    integer("max_loras", 1, MAX_LORAS),
    integer("max_lora_rank", 1, MAX_LORA_RANK),
    integer("max_cpu_loras", 1, MAX_CPU_LORAS, optional=True),
    one_of("data_parallel_backend", DATA_PARALLEL_BACKENDS),
    Rule(
        "data_parallel_address",
        _address,
        "None or one interface's host name or IP address (not all interfaces)",
    ),
)


def check_fields(args: object) -> None:
    """Every rule of `RULES` on `args`' fields; raises the first failure."""
    for rule in RULES:
        value = getattr(args, rule.name)
        if not rule.check(value):
            raise fail(rule.name, value, rule.allowed)


def parse_cpu_list(spec: str) -> list[int] | None:
    """The CPUs of a `cpu_bind` list such as "2-7" or "0,2,4-5"; None for "auto" and
    "nobind". Raises ConfigError naming `cpu_bind` on anything else."""
    if spec in ("auto", "nobind"):
        return None
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, dash, hi = part.strip().partition("-")
            first, last = int(lo), int(hi if dash else lo)
            if first < 0 or last < first or last >= 4096:
                raise ValueError(part)
            cpus.update(range(first, last + 1))
    except ValueError:
        raise fail(
            "cpu_bind", spec, "'auto', 'nobind' or a CPU list such as '2-7' or '0,2,4-5'"
        ) from None
    return sorted(cpus)
