"""Speculative decoding's draft-model method: a smaller model with the target's
tokenizer, run by the same runner with its own KV cache and its own blocks.

Each row holds blocks of the draft's pool (a free list over the draft's KV
tensors), given back when its request leaves the batch (finished, aborted or
preempted: a resumed request starts its draft over). `num_computed[row]` counts
the row's tokens whose draft K/V is in place; only tokens the target kept count,
so the K/V the draft wrote for its own proposals is written over next time.

After each step `propose` runs k forwards of the draft for all rows at once: the
first feeds each row's tokens the draft has not seen (its prompt on the first
step, then the tokens accepted since) and takes the argmax after the last one;
each later forward feeds the draft token before it (greedy proposals: the
target's draw decides what is kept, so any proposal leaves the output exact). A
row the pool cannot hold proposes nothing; its request decodes as without
speculation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.models.attention import build_attention_metadata
from asyncllm.models.hf_config import load_hf_config
from asyncllm.models.loader import load_model
from asyncllm.models.native_ops import use_native_ops
from asyncllm.worker.input_batch import InputBatch
from asyncllm.worker.kv_cache import allocate_kv_caches


class DraftModel:
    """The draft model, its KV cache and each row's blocks in it."""

    def __init__(
        self, config: EngineConfig, path: str, num_blocks: int, target_vocab_size: int
    ) -> None:
        self.device = config.torch_device
        self.block_size = config.block_size
        hf_config = load_hf_config(path)
        context = getattr(hf_config, "max_position_embeddings", None)
        if isinstance(context, int) and context < config.max_model_len:
            raise ConfigError(
                f"EngineArgs.speculative_config['model']={path!r} is invalid with "
                f"max_model_len={config.max_model_len}: the draft model's context is "
                f"{context} positions; lower max_model_len or use a draft with a longer one"
            )
        self.model: Any = load_model(path, hf_config, config.torch_dtype, self.device, None)
        use_native_ops(self.model)
        self.kv_caches = allocate_kv_caches(config, self.model, num_blocks)
        # the draft may pad its vocabulary: it proposes only the target's tokens
        self.vocab_size = min(int(self.model.vocab_size), target_vocab_size)
        rows = config.max_num_seqs
        max_blocks = -(-config.max_model_len // config.block_size)
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables = np.zeros((rows, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int32)
        self.num_computed = np.zeros(rows, dtype=np.int32)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def remove(self, row: int) -> None:
        """Give back `row`'s blocks; its next request starts with none."""
        n = int(self.num_blocks[row])
        self.free.extend(self.tables[row, :n].tolist())
        self.num_blocks[row] = 0
        self.num_computed[row] = 0

    def _can_hold(self, row: int, num_positions: int) -> bool:
        """Give `row` the blocks `num_positions` positions need; False when the
        pool is short (it then keeps what it had)."""
        need = -(-num_positions // self.block_size) - int(self.num_blocks[row])
        if need <= 0:
            return True
        if need > len(self.free) or num_positions > self.tables.shape[1] * self.block_size:
            return False
        n = int(self.num_blocks[row])
        self.tables[row, n : n + need] = [self.free.pop() for _ in range(need)]
        self.num_blocks[row] = n + need
        return True

    def propose(self, ib: InputBatch, rows: np.ndarray, max_drafts: np.ndarray) -> list[list[int]]:
        """Up to `max_drafts[i]` draft tokens for each of `rows` (whose tokens
        `ib` holds, the newest included)."""
        out: list[list[int]] = [[] for _ in range(len(rows))]
        ends = ib.num_tokens[rows].astype(np.int64)
        live = [
            i
            for i in range(len(rows))
            if max_drafts[i] > 0 and self._can_hold(int(rows[i]), int(ends[i] + max_drafts[i] - 1))
        ]
        if not live:
            return out
        r = rows[live]
        start = self.num_computed[r].astype(np.int64)
        segs = [ib.token_ids[row, s:e] for row, s, e in zip(r, start, ends[live], strict=True)]
        tokens = self._forward(r, start, segs)
        self.num_computed[r] = ends[live]
        pos = ends[live]  # where each row's newest draft token goes
        while True:
            for i, t in zip(live, tokens.tolist(), strict=True):
                out[i].append(t)
            more = [j for j, i in enumerate(live) if len(out[i]) < max_drafts[i]]
            if not more:
                return out
            live, pos = [live[j] for j in more], pos[more]
            tokens = self._forward(rows[live], pos, [tokens[j : j + 1] for j in more])
            pos = pos + 1

    def _forward(self, rows: np.ndarray, start: np.ndarray, segs: list[np.ndarray]) -> np.ndarray:
        """Run the draft over each row's tokens `segs[i]`, at positions from
        `start[i]` on; the argmax after each row's last token, in `rows`' order."""
        q = np.fromiter((len(s) for s in segs), dtype=np.int64, count=len(segs))
        order = np.argsort(q != 1, kind="stable")  # attention takes decodes first
        rows_o, start_o, q_o = rows[order], start[order], q[order]
        cu = np.cumsum(q_o)
        seq = np.repeat(np.arange(len(rows_o)), q_o)
        pos = np.arange(int(cu[-1]), dtype=np.int64) + np.repeat(start_o - (cu - q_o), q_o)
        ids = np.concatenate([segs[o] for o in order.tolist()]).astype(np.int64)
        bs = self.block_size
        tables = self.tables[rows_o]
        slots = tables[seq, pos // bs].astype(np.int64) * bs + pos % bs
        meta = build_attention_metadata(q_o, start_o, tables, slots, bs, self.device)
        hidden = self.model(
            torch.from_numpy(ids).to(self.device),
            torch.from_numpy(pos).to(self.device),
            self.kv_caches,
            meta,
        )
        last = torch.from_numpy(cu - 1).to(self.device)
        logits = self.model.compute_logits(hidden[last])[:, : self.vocab_size]
        drafts = torch.argmax(logits, dim=-1).cpu().numpy()
        result = np.empty_like(drafts)
        result[order] = drafts
        return result
