"""The utility calls the front end may make of the engine core, by name.

Each entry of the table takes the call's args (any msgpack value) and returns its
result; a name not in the table is an unknown method. A new call is one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncllm.core.queue_time import QUEUE_TIME_BUCKETS
from asyncllm.engine.core import EngineCore
from asyncllm.engine.step_timers import StepTimers
from asyncllm.errors import InvalidRequestError
from asyncllm.lora.request import LoRARequest

UtilityCall = Callable[[Any], Any]


def utility_calls(core: EngineCore, timers: StepTimers) -> dict[str, UtilityCall]:
    """Method name -> the call, over this core and its process's timers."""
    return {
        "check_health": lambda args: True,
        "get_stats": lambda args: stats_report(core),
        "reset_prefix_cache": lambda args: core.reset_prefix_cache(),
        "start_profile": lambda args: core.start_profile(),
        "stop_profile": lambda args: core.stop_profile(),
        "get_step_timings": lambda args: timers.report(clear=bool(args and args.get("clear"))),
        "add_lora": lambda args: core.add_lora(_lora_request(args)),
        "remove_lora": lambda args: core.remove_lora(int(args)),
        "list_loras": lambda args: core.list_loras(),
    }


def _lora_request(args: Any) -> LoRARequest:
    if not isinstance(args, dict):
        raise InvalidRequestError("add_lora takes {lora_name, lora_int_id, lora_path}")
    return LoRARequest(args.get("lora_name"), args.get("lora_int_id"), args.get("lora_path"))  # type: ignore[arg-type]


def stats_report(core: EngineCore) -> dict[str, Any]:
    """`get_stats`: the scheduler's stats with the KV cache's, the queue-time
    histogram's and the grammar cache's figures, and speculative decoding's
    acceptance counters when it is on."""
    s = core.stats()
    spec = core.scheduler.spec_stats
    return (
        (spec.report() if spec is not None else {})
        | {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_cache_usage": s.kv_cache_usage,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "num_preemptions": s.num_preemptions,
            "num_free_blocks": core.kv_cache.num_free_blocks,
            "num_blocks": core.num_kv_blocks,
            "num_unfinished": core.scheduler.num_unfinished,
            "queue_time_buckets": list(QUEUE_TIME_BUCKETS),
            "queue_time_cumulative": core.scheduler.queue_time.cumulative(),
            "queue_time_sum": core.scheduler.queue_time.sum,
            "grammar_cache_bytes": core.grammars.num_bytes,
            "grammar_cache_entries": core.grammars.num_entries,
        }
        | core.lora_stats()
    )
