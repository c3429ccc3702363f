"""A tensor-parallel worker process (ranks 1..N-1): `python -m
asyncllm.executor.worker_proc`, started by the engine core's executor.

    start-up   load this rank's shard, size its KV cache, write b"R" on the
               status pipe (or b"E" + the error text, then exit 1); join the
               torch.distributed group; agree on the KV block count
    steps      receive rank 0's step message, build the same attention metadata,
               run the forward pass (its collectives pair with rank 0's), compute
               the sampled rows' logits for rank 0's gather; until STOP
    liveness   a thread writes b"H" on the status pipe every HEARTBEAT_S, which
               the core's watchdog reads; a failure writes b"E", its length
               (4 bytes, little-endian) and its text; the process exits when its
               stdin (a pipe from the core) closes, so it never outlives the core

Like the engine core it ignores SIGINT and SIGTERM: a signal to the process
group must not kill a rank before the front end has drained.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback

from asyncllm import envs
from asyncllm.config import EngineConfig

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25
_MAX_ERROR_BYTES = 4000  # one pipe write (atomic below PIPE_BUF)


def _watch_parent() -> None:
    """Exit when the engine core goes away (EOF on stdin, a pipe it holds)."""
    try:
        while os.read(0, 1024):
            pass
    except OSError:
        pass
    os._exit(0)


def _heartbeat(fd: int) -> None:
    try:
        while True:
            os.write(fd, b"H")
            time.sleep(HEARTBEAT_S)
    except OSError:  # the core closed its end: it is going away
        os._exit(0)


def run_worker(config: EngineConfig, rank: int, size: int, store: str, status_fd: int) -> None:
    """Start up, report, then serve steps until STOP. Raises on failure."""
    import torch

    from asyncllm.executor.distributed import init_group, threads_per_rank
    from asyncllm.executor.step_channel import END_LOGITS, LOGITS, STEP, STOP, StepReceiver
    from asyncllm.models.attention import build_attention_metadata
    from asyncllm.models.hf_config import load_hf_config
    from asyncllm.models.loader import load_model
    from asyncllm.models.parallel_state import set_tensor_parallel
    from asyncllm.worker.kv_cache import allocate_kv_caches, num_kv_blocks_for

    device = config.torch_device
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    threads = threads_per_rank(config)
    if threads is not None:
        torch.set_num_threads(threads)
    set_tensor_parallel(rank, size)
    model = load_model(config.model, load_hf_config(config.model), config.torch_dtype, device)
    num_blocks = num_kv_blocks_for(config, model)
    os.write(status_fd, b"R")
    threading.Thread(target=_heartbeat, args=(status_fd,), name="heartbeat", daemon=True).start()

    step_group = init_group(store, rank, size, config.device)
    agreed = torch.tensor([num_blocks], dtype=torch.int64)
    torch.distributed.all_reduce(agreed, torch.distributed.ReduceOp.MIN, group=step_group)
    kv_caches = allocate_kv_caches(config, model, int(agreed.item()))
    channel = StepReceiver(step_group, model.hidden_size, config.torch_dtype)
    bs = config.block_size
    with torch.inference_mode():
        while True:
            header = channel.recv_header()
            if header[0] == STOP:
                return
            if header[0] != STEP:
                raise RuntimeError(f"expected a step message, got kind {header[0]}")
            ids, pos, q, ctx, bt, slots, rows = channel.recv_step(header)
            meta = build_attention_metadata(q, ctx, bt, slots, bs, device)
            hidden = model(
                torch.from_numpy(ids).to(device), torch.from_numpy(pos).to(device), kv_caches, meta
            )
            if header[5]:  # prompt logprobs: rank 0 sends each extra row block
                while (extra := channel.recv_header())[0] != END_LOGITS:
                    if extra[0] != LOGITS:
                        raise RuntimeError(f"expected a logits message, got kind {extra[0]}")
                    model.compute_logits(channel.recv_rows(extra).to(device))
            if len(rows):
                model.compute_logits(hidden[torch.from_numpy(rows).to(device)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncllm.executor.worker_proc")
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--store", required=True, help="the rendezvous FileStore's path")
    ap.add_argument("--status-fd", type=int, required=True, help="pipe to the core")
    opts = ap.parse_args(argv)
    logging.basicConfig(
        level=envs.log_level(),
        format=f"%(asctime)s tp-rank-{opts.rank} %(levelname)s %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, name="parent-watch", daemon=True).start()
    try:
        config = EngineConfig(**json.loads(opts.config))
        run_worker(config, opts.rank, opts.size, opts.store, opts.status_fd)
        return 0
    except BaseException as exc:
        traceback.print_exc()
        text = f"{type(exc).__name__}: {exc}".encode()[:_MAX_ERROR_BYTES]
        try:  # one write: the heartbeat thread's bytes cannot split it
            os.write(opts.status_fd, b"E" + len(text).to_bytes(4, "little") + text)
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
