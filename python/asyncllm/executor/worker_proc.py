"""A tensor-parallel worker process (ranks 1..N-1): `python -m
asyncllm.executor.worker_proc`, started by the engine core's executor.

    start-up   load this rank's shard, size its KV cache, write b"R" on the
               status pipe (or b"E" + the error text, then exit 1); join the
               torch.distributed group; agree on the KV block count
    steps      receive rank 0's step message, build the same attention metadata,
               follow rank 0's adapter events and token→slot map (lora/ranks.py),
               run the forward pass (its collectives pair with rank 0's), compute
               the sampled rows' logits for rank 0's gather; until STOP
    liveness   a thread writes b"H" on the status pipe every HEARTBEAT_S, which
               the core's watchdog reads; a failure writes b"E", its length
               (4 bytes, little-endian) and its text; the process exits when its
               stdin (a pipe from the core) closes, so it never outlives the core

Started by the Ray executor (`--hub`), the same bytes go to rank 0 over a CURVE
socket instead of the pipe, the rendezvous is rank 0's store behind it
(executor/hub.py), and stdin is a pipe from this rank's Ray actor: the worker exits
with its actor, which Ray ends with the core.

Like the engine core it ignores SIGINT and SIGTERM: a signal to the process
group must not kill a rank before the front end has drained.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Protocol

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


class Link(Protocol):
    """How a worker reaches rank 0: its status bytes, its rendezvous store, the
    interface for gloo's sockets, and its CUDA device."""

    def send(self, data: bytes) -> None: ...

    def store(self, size: int) -> Any: ...

    def interface(self) -> str: ...

    def cuda_index(self, rank: int) -> int: ...

    def close(self) -> None: ...


class PipeLink:
    """The multiprocess executor's: a pipe, a FileStore, loopback, GPU `rank`."""

    def __init__(self, status_fd: int, store_path: str) -> None:
        self.fd = status_fd
        self.store_path = store_path

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)  # one write: below PIPE_BUF, never split

    def store(self, size: int) -> Any:
        import torch.distributed as dist

        return dist.FileStore(self.store_path, size)

    def interface(self) -> str:
        from asyncllm.executor.distributed import loopback_interface

        return loopback_interface()

    def cuda_index(self, rank: int) -> int:
        return rank

    def close(self) -> None:
        pass


class RayLink:
    """The Ray executor's: rank 0's hub over CURVE, the interface that reaches it,
    and the one GPU Ray gave this rank's actor (CUDA_VISIBLE_DEVICES)."""

    def __init__(self, endpoint: str, rank: int) -> None:
        from asyncllm.curve import take_client_keys
        from asyncllm.executor.hub import HubLink

        keys = take_client_keys(WORKER_KEYS_ENV)
        if keys is None:
            raise RuntimeError(f"--hub needs the CURVE keys in ${WORKER_KEYS_ENV}")
        self.endpoint = endpoint
        self.hub = HubLink(endpoint, keys, rank)

    def send(self, data: bytes) -> None:
        self.hub.send(data)

    def store(self, size: int) -> Any:
        return self.hub.store

    def interface(self) -> str:
        from asyncllm.executor.distributed import interface_towards

        host = self.endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        return interface_towards(host)

    def cuda_index(self, rank: int) -> int:
        return 0

    def close(self) -> None:
        self.hub.close()


# The Ray executor hands each worker its CURVE keys here (never on a command line).
WORKER_KEYS_ENV = "ASYNCLLM_TP_CURVE_KEYS"


def status_error(data: bytes | bytearray) -> str | None:
    """The error in a worker's status bytes (b"E", length, text), if any."""
    i = data.find(b"E")
    if i < 0 or len(data) < i + 5:
        return None
    n = int.from_bytes(data[i + 1 : i + 5], "little")
    return bytes(data[i + 5 : i + 5 + n]).decode(errors="replace")


def _heartbeat(link: Link) -> None:
    try:
        while True:
            link.send(b"H")
            time.sleep(HEARTBEAT_S)
    except Exception:  # the core closed its end (or the link): it is going away
        os._exit(0)


def run_worker(config: EngineConfig, rank: int, size: int, link: Link) -> None:
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
        index = link.cuda_index(rank)
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    threads = threads_per_rank(config)
    if threads is not None:
        torch.set_num_threads(threads)
    set_tensor_parallel(rank, size)
    hf_config = load_hf_config(config.model)
    model = load_model(config.model, hf_config, config.torch_dtype, device, config.quantization)
    num_blocks = num_kv_blocks_for(config, model)
    link.send(b"R")
    threading.Thread(target=_heartbeat, args=(link,), name="heartbeat", daemon=True).start()

    step_group = init_group(link.store(size), rank, size, config.device, link.interface())
    agreed = torch.tensor([num_blocks], dtype=torch.int64)
    torch.distributed.all_reduce(agreed, torch.distributed.ReduceOp.MIN, group=step_group)
    kv_caches = allocate_kv_caches(config, model, int(agreed.item()))
    lora = mirror = None
    if config.lora is not None:
        from asyncllm.lora.model import LoRAModel
        from asyncllm.lora.ranks import AdapterMirror

        lora = LoRAModel.for_engine(model, config, device)
        mirror = AdapterMirror(lora, same_files=isinstance(link, PipeLink))
    channel = StepReceiver(step_group, model.hidden_size, config.torch_dtype)
    bs = config.block_size
    with torch.inference_mode():
        while True:
            header = channel.recv_header()
            if header[0] == STOP:
                if mirror is not None:
                    mirror.close()
                return
            if header[0] != STEP:
                raise RuntimeError(f"expected a step message, got kind {header[0]}")
            ids, pos, q, ctx, bt, slots, rows, lora_slots, events = channel.recv_step(header)
            if lora is not None and mirror is not None:
                mirror.apply(events)
                lora.begin_step(lora_slots if len(lora_slots) else None)
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
    ap.add_argument("--store", help="the rendezvous FileStore's path (with --status-fd)")
    ap.add_argument("--status-fd", type=int, help="pipe to the core (with --store)")
    ap.add_argument("--hub", help="rank 0's CURVE endpoint, tcp://HOST:PORT (Ray executor)")
    opts = ap.parse_args(argv)
    if (opts.hub is None) == (opts.store is None or opts.status_fd is None):
        ap.error("give either --hub or both --store and --status-fd")
    logging.basicConfig(
        level=envs.log_level(),
        format=f"%(asctime)s tp-rank-{opts.rank} %(levelname)s %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, name="parent-watch", daemon=True).start()
    link: Link | None = None
    try:
        if opts.hub is not None:
            link = RayLink(opts.hub, opts.rank)
        else:
            link = PipeLink(opts.status_fd, opts.store)
        config = EngineConfig.from_json(opts.config)
        run_worker(config, opts.rank, opts.size, link)
        return 0
    except BaseException as exc:
        traceback.print_exc()
        text = f"{type(exc).__name__}: {exc}".encode()[:_MAX_ERROR_BYTES]
        try:  # one write: the heartbeat thread's bytes cannot split it
            if link is not None:
                link.send(b"E" + len(text).to_bytes(4, "little") + text)
        except Exception:
            pass
        return 1
    finally:
        if link is not None:
            link.close()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
