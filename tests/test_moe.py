"""The grouped expert computation against its per-token definition: equal exactly
in fp32, with ties in the router and experts that receive no token.

MKL rounds a matmul row differently depending on how many rows the call has, so
bit-equality between one matmul per expert and one per token needs inputs whose
products and sums are exact: small integers and ReLU. Any pair routed to the
wrong expert, lost or counted twice still changes the result. With SiLU and random
floats the two agree to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from asyncllm.models.moe import grouped_experts, reference_experts, route

HIDDEN, INTER, EXPERTS = 64, 32, 8


def _experts(seed: int, integer: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if integer:  # every product and partial sum is an integer below 2^24: exact
        gate_up = torch.randint(-3, 4, (EXPERTS, 2 * INTER, HIDDEN), generator=g).float()
        down = torch.randint(-3, 4, (EXPERTS, HIDDEN, INTER), generator=g).float()
        return gate_up, down
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.2
    return gate_up, down


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
@pytest.mark.parametrize("padded", [None, True, False], ids=["chosen", "padded", "loop"])
def test_grouped_equals_per_token_exactly(
    top_k: int, renormalize: bool, num_tokens: int, padded: bool | None
) -> None:
    """Both ways of grouping (every expert padded to the busiest in two batched
    matmuls, or a matmul pair per busy expert), and the one the loads choose."""
    g = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    x = torch.randint(-2, 3, (num_tokens, HIDDEN), generator=g).float()
    router = torch.randn(EXPERTS, HIDDEN, generator=g)
    router[3] = router[2]  # experts 2 and 3 tie for every token
    logits = x @ router.T
    logits[:, 6:] = -1e4  # experts 6 and 7 are never chosen: they get no tokens
    weights, ids = route(logits, top_k, renormalize)
    if top_k > 1 and num_tokens > 1:
        assert bool(((ids == 2).any(1) & (ids == 3).any(1)).any())  # a tie taken
    assert not bool((ids >= 6).any())
    gate_up, down = _experts(top_k, integer=True)
    got = grouped_experts(x, weights, ids, gate_up, down, act=torch.relu, padded=padded)
    want = reference_experts(x, weights, ids, gate_up, down, act=torch.relu)
    assert torch.equal(got, want)
    assert got.abs().sum() > 0

    x = torch.randn(num_tokens, HIDDEN, generator=g)
    logits = x @ router.T
    logits[:, 6:] = -1e4
    weights, ids = route(logits, top_k, renormalize)
    gate_up, down = _experts(top_k, integer=False)
    got = grouped_experts(x, weights, ids, gate_up, down, padded=padded)
    want = reference_experts(x, weights, ids, gate_up, down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_route_softmax_then_top_k_then_renormalise() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids[0, 0].item() == 0 and ids[0, 1].item() in (1, 2)
    torch.testing.assert_close(weights[0], probs[0, [0, 1]])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))
