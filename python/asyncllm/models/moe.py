"""Mixture-of-experts MLP: a softmax router picks each token's top-k experts and
the experts' outputs are summed with the router's weights.

The expert computation is grouped: the step's (token, expert) pairs are sorted by
expert, so each active expert runs one matmul over all its tokens, instead of one
per token (a dense loop) or every expert over every token. `reference_experts` is
the per-token definition the grouped path is tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.models.layers import SwiGLUMLP


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64): softmax over all experts in
    float32, then the top k, renormalised to sum to 1 when the config says so
    (Mixtral always; Qwen MoE by `norm_topk_prob`), as transformers does."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    padded: bool | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, where
    expert_e(x) = down[e] @ (act(gate_e x) * up_e x) with gate_up[e] = [gate_e; up_e].

    x [T, H]; weights/ids [T, k]; gate_up [E, 2I, H]; down [E, H, I]. The (token,
    expert) pairs are sorted by expert. When the experts' loads are even enough
    that padding every expert to the busiest one at most doubles the rows (decode
    batches: most experts busy), two batched matmuls run every expert at once, a
    handful of ops whatever the expert count, split over the threads by expert;
    otherwise one matmul pair per expert that has tokens, and experts with none
    cost nothing. `padded` forces one way (tests and benchmarks)."""
    num_tokens, top_k = ids.shape
    num_experts = gate_up.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts_t = torch.bincount(flat, minlength=num_experts)
    counts = counts_t.tolist()
    busiest = max(counts)
    if padded is None:
        padded = num_experts * busiest <= 2 * flat.numel()
    if padded:
        per_pair = _padded_experts(x, flat, order, counts_t, busiest, top_k, gate_up, down, act)
    else:
        per_pair = _expert_loop(x, order, counts, top_k, gate_up, down, act)
    scaled = per_pair.view(num_tokens, top_k, -1) * weights.to(x.dtype).unsqueeze(-1)
    return _sum_ranks(scaled)


def _expert_loop(
    x: torch.Tensor,
    order: torch.Tensor,
    counts: list[int],
    top_k: int,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Each pair's expert output [T * k, H] in (token, rank) order: one matmul
    pair per expert with tokens, over its tokens (pairs sorted by `order`)."""
    rows = x.index_select(0, order // top_k)  # each pair's token, grouped by expert
    inter = gate_up.shape[1] // 2
    parts = []
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        gate, up = F.linear(rows[start : start + n], gate_up[expert]).split(inter, dim=-1)
        parts.append(F.linear(act(gate) * up, down[expert]))
        start += n
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    # Back to (token, rank) order.
    per_pair = torch.empty_like(out)
    per_pair[order] = out
    return per_pair


def _padded_experts(
    x: torch.Tensor,
    flat: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    busiest: int,
    top_k: int,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Each pair's expert output [T * k, H] in (token, rank) order, from two
    batched matmuls over [E, busiest, H]: expert e's pairs fill its first rows,
    zeros the rest (computed, never read)."""
    num_experts, hidden = gate_up.shape[0], x.shape[1]
    expert = flat.index_select(0, order)  # the pairs' experts, sorted
    first = torch.cumsum(counts, 0) - counts  # each expert's first sorted pair
    rank_in_expert = torch.arange(flat.numel(), device=x.device) - first.index_select(0, expert)
    slot_sorted = expert * busiest + rank_in_expert
    rows = x.new_zeros(num_experts * busiest, hidden)
    rows.index_copy_(0, slot_sorted, x.index_select(0, order // top_k))
    gate, up = torch.bmm(rows.view(num_experts, busiest, hidden), gate_up.transpose(1, 2)).split(
        gate_up.shape[1] // 2, dim=-1
    )
    out = torch.bmm(act(gate) * up, down.transpose(1, 2)).view(num_experts * busiest, hidden)
    slot = torch.empty_like(slot_sorted)
    slot[order] = slot_sorted  # each pair's row, in (token, rank) order
    return out.index_select(0, slot)


def reference_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """The per-token loop `grouped_experts` computes (for tests and benchmarks)."""
    inter = gate_up.shape[1] // 2
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        parts = []
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = F.linear(x[t : t + 1], gate_up[e]).split(inter, dim=-1)
            parts.append(F.linear(act(gate) * up, down[e]) * weights[t, j].to(x.dtype))
        out[t] = _sum_ranks(torch.stack(parts, dim=1))[0]
    return out


def _sum_ranks(scaled: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> [T, H], adding rank by rank (a fixed order, so the grouped and
    per-token paths round identically)."""
    total = scaled[:, 0]
    for j in range(1, scaled.shape[1]):
        total = total + scaled[:, j]
    return total


class SparseMoE(nn.Module):
    """The MoE MLP of one layer: router `gate`, stacked expert weights, and an
    optional shared expert with a sigmoid gate (Qwen2-MoE)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.shared_expert: SwiGLUMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate_size:
            self.shared_expert = SwiGLUMLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = grouped_experts(x, weights, ids, self.experts_gate_up, self.experts_down)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def expert_sources(prefix: str, num_experts: int, names: tuple[str, ...]) -> list[str]:
    """Checkpoint tensors of stacked expert weights: for each expert in order, the
    named projections (e.g. gate then up), each [rows, cols]; the loader stacks them."""
    return [f"{prefix}.experts.{e}.{n}.weight" for e in range(num_experts) for n in names]
