"""One thread-placement policy for every entry point: where the engine core's torch
threads run beside the front end.

The model's OpenMP team and the front end (detokenizer, event loop, HTTP server,
the core's IO threads) share the CPUs; when the front end works while the model
runs, a team on every CPU makes both wait for each other, and a stream's output
arrives in bursts. Measured with `benches/bench_threads.py` (RESULTS.md):

    serve, AsyncLLM     the front end streams while the model runs: the model on all
                        CPUs but one, its process pinned apart from the front end
                        (in-process AsyncLLM, whose core is a thread of the caller:
                        the thread count only). On 2 CPUs, in-process AsyncLLM at 64
                        streams ran 3.7x the tokens/s of torch's default
    LLM (offline)       the front end idles during `generate`: torch's default (one
                        thread per physical core), unpinned, and libgomp's own wait
                        policy (spin a while, then sleep): a decode step runs ~150
                        parallel regions microseconds apart, and workers that sleep
                        at once wake ~150 times a step (SmolLM2 Q4_1 at batch 1 on
                        a 2-CPU Zen 5: 12.6 ms a token passive, 6.4 ms spinning)
    OpenMP wait policy  "auto" (the default) is the above for offline; elsewhere
                        passive, so idle workers leave the CPU to the front end

Left alone, whatever the entry point: a setting the user made (`num_threads`,
`pin_threads`), data or tensor parallelism (the CPUs are shared out among cores or
ranks), cores placed by Ray, and OMP_NUM_THREADS.

`cpu_bind` (ASYNCLLM_CPU_OMP_THREADS_BIND, vLLM's VLLM_CPU_OMP_THREADS_BIND) overrides
the policy: "auto" applies it; "nobind" pins nothing and leaves the thread count to
torch; a CPU list ("2-7", "0,2,4-5") runs the core on exactly those CPUs, one torch
thread each, and the front end on the others.
"""

from __future__ import annotations

import dataclasses
import os

from asyncllm.config import EngineArgs
from asyncllm.config_rules import parse_cpu_list
from asyncllm.errors import ConfigError

ENTRY_POINTS = ("serve", "async", "offline")


def usable_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def placement(args: EngineArgs, entry: str, *, in_process: bool = False) -> EngineArgs:
    """`args` with the thread settings this entry point runs best with, where the
    user set none (see the module docstring); `in_process`: the core is a thread of
    this process, so nothing can be pinned apart from the front end."""
    if entry not in ENTRY_POINTS:
        raise ValueError(f"entry must be one of {ENTRY_POINTS}, got {entry!r}")
    if args.omp_wait_policy == "auto":
        policy = "inherit" if entry == "offline" else "passive"
        args = dataclasses.replace(args, omp_wait_policy=policy)
    if (
        args.data_parallel_size > 1
        or args.tensor_parallel_size > 1
        or args.data_parallel_backend == "ray"
        or (args.num_threads is None and os.environ.get("OMP_NUM_THREADS"))
    ):
        return args
    bound = parse_cpu_list(args.cpu_bind)
    cpus = usable_cpus()
    if args.cpu_bind == "nobind":
        return dataclasses.replace(args, pin_threads=bool(args.pin_threads))
    if bound is not None:
        missing = sorted(set(bound) - set(cpus))
        if missing:
            raise ConfigError(
                f"cpu_bind={args.cpu_bind!r} names CPUs {missing} this process cannot "
                f"run on (it may use {cpus})"
            )
        threads = args.num_threads if args.num_threads is not None else len(bound)
        return dataclasses.replace(args, num_threads=threads, pin_threads=not in_process)
    if entry == "offline":
        return args
    threads = args.num_threads if args.num_threads is not None else max(1, len(cpus) - 1)
    pin = args.pin_threads
    if pin is None:
        pin = threads < len(cpus) and not in_process
    return dataclasses.replace(args, num_threads=threads, pin_threads=pin)
