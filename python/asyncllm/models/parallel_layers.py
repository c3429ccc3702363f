"""Megatron-style tensor-parallel layers for the Llama family, and which slice of
each checkpoint tensor a rank loads.

    q/k/v, gate/up   column-parallel: each rank holds its heads' (its
                     intermediate columns') rows; no communication
    o, down          row-parallel: each rank multiplies its input columns, one
                     all-reduce sums the partial results
    embedding        vocabulary-parallel: each rank holds ceil(V / tp) rows and
                     embeds the ids that fall in them (zeros elsewhere); one
                     all-reduce
    LM head          vocabulary-parallel (the embedding's rows when tied): each
                     rank scores its rows, rank 0 gathers them; only the rows the
                     runner samples (or scores) are computed at all

KV heads are split across ranks; with fewer KV heads than ranks each rank keeps
the one its query heads read (replicated over tp / num_kv_heads ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import ModelLoadError


@dataclass(frozen=True)
class TPLayout:
    """How one model is split over `size` ranks, seen from `rank`."""

    rank: int
    size: int
    num_heads: int  # query heads of this rank
    num_kv_heads: int  # KV heads of this rank (1 when replicated)
    first_kv_head: int  # its first KV head in the checkpoint
    intermediate: int  # MLP columns of this rank
    vocab_per_rank: int  # embedding / LM-head rows per rank (the last may be padding)
    total_kv_heads: int  # KV heads of the whole model

    @classmethod
    def of(cls, cfg: Any, num_kv_heads: int, rank: int, size: int) -> TPLayout:
        """The layout, or ModelLoadError naming the field that does not divide."""
        heads, inter = cfg.num_attention_heads, cfg.intermediate_size
        name = f"EngineArgs.tensor_parallel_size={size}"
        if heads % size:
            raise ModelLoadError(f"{name} does not divide the model's {heads} attention heads")
        if inter % size:
            raise ModelLoadError(f"{name} does not divide its intermediate_size {inter}")
        if num_kv_heads % size and size % num_kv_heads:
            raise ModelLoadError(
                f"{name} and the model's {num_kv_heads} KV heads: one must divide the other"
            )
        if num_kv_heads >= size:
            kv, first = num_kv_heads // size, rank * (num_kv_heads // size)
        else:
            kv, first = 1, rank * num_kv_heads // size
        vocab = -(-cfg.vocab_size // size)
        return cls(rank, size, heads // size, kv, first, inter // size, vocab, num_kv_heads)


class RowParallelLinear(nn.Linear):
    """y = x W^T with W's input columns split across ranks: each rank adds its
    partial product in one all-reduce. No bias (the Llama family has none here).

    `partial` is the rank's product before the all-reduce: a LoRA layer over this
    one adds its own share there (lora/layers.py), so adapters cost no collective."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.partial(x)
        dist.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows are split across ranks ([rank * n, (rank + 1) * n));
    ids outside a rank's rows embed to zero there, and one all-reduce sums."""

    def __init__(self, vocab_per_rank: int, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.vocab_per_rank = vocab_per_rank
        self.start = rank * vocab_per_rank
        self.weight = nn.Parameter(torch.empty(vocab_per_rank, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(out)
        return out


def gather_logits(local: torch.Tensor, vocab_size: int, rank: int, size: int) -> torch.Tensor:
    """Each rank's float32 logits [n, vocab_per_rank] -> [n, vocab] on rank 0 (the
    only rank that samples); the other ranks get their local logits back."""
    local = local.contiguous()
    if rank != 0:
        dist.gather(local, None, dst=0)
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.gather(local, parts, dst=0)
    return torch.cat(parts, dim=1)[:, :vocab_size]


@dataclass(frozen=True)
class Shard:
    """The part of one checkpoint tensor a rank loads: rows (dim 0) or columns
    (dim 1) [start, stop) of the `total` the unsharded tensor has along that dim,
    or all of it (dim None)."""

    source: str
    dim: int | None = None
    start: int = 0
    stop: int = 0
    total: int = 0


def weight_shards(
    name: str, sources: list[str], layout: TPLayout, head_dim: int, vocab_size: int
) -> list[Shard]:
    """The slices of `sources` (the checkpoint tensors of parameter `name`, as
    `weight_sources` gives them) that this rank's parameter is made of."""
    r, size = layout.rank, layout.size
    prefix, _, _ = name.rpartition(".")
    if prefix.endswith("qkv_proj"):
        q, k, v = sources
        qn, kvn = layout.num_heads * head_dim, layout.num_kv_heads * head_dim
        k0, kv_total = layout.first_kv_head * head_dim, layout.total_kv_heads * head_dim
        return [
            Shard(q, 0, r * qn, (r + 1) * qn, size * qn),
            Shard(k, 0, k0, k0 + kvn, kv_total),
            Shard(v, 0, k0, k0 + kvn, kv_total),
        ]
    if prefix.endswith("o_proj"):
        qn = layout.num_heads * head_dim
        return [Shard(sources[0], 1, r * qn, (r + 1) * qn, size * qn)]
    if prefix.endswith("gate_up_proj"):
        n = layout.intermediate
        return [Shard(s, 0, r * n, (r + 1) * n, size * n) for s in sources]
    if prefix.endswith("down_proj"):
        n = layout.intermediate
        return [Shard(sources[0], 1, r * n, (r + 1) * n, size * n)]
    if prefix in ("embed_tokens", "lm_head"):
        n, vs = layout.vocab_per_rank, vocab_size
        return [Shard(sources[0], 0, min(r * n, vs), min((r + 1) * n, vs), vs)]
    return [Shard(s) for s in sources]
