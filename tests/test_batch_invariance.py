"""Batch invariance through the engine (`batch_invariant=True`): a prompt gives the
same bits alone and inside a batch whose token budget chunks its prompt
differently — greedy and seeded sampling, float32 and bfloat16. The linear layers
run the rust kernel (one reduction order for any row count), prompt tokens attend
one by one on the decode kernel (`AttentionMetadata.token_wise`), the sampler
draws per row."""

from __future__ import annotations

import pytest

from asyncllm import LLM, SamplingParams

PROMPT = "def fibonacci(n):\n    " + "# compute the numbers one after another\n    " * 6
OTHERS = ["import os\n", "class Stack:\n    def push(self, x):", "for i in range(10):", "x = [1, 2"]


def _run(
    llm: LLM, prompts: list[str], params: SamplingParams
) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [next(iter(step.values())).logprob for step in o.outputs[0].logprobs or []],
        )
        for o in outs
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompt_gives_the_same_bits_alone_and_in_a_chunked_batch(dtype: str) -> None:
    # a budget of 24 tokens a step: the prompt (~50 tokens) is chunked at other
    # places alone than behind the others
    llm = LLM(
        batch_invariant=True,
        multiprocess=False,
        dtype=dtype,
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
    )
    try:
        assert len(llm.get_tokenizer().encode(PROMPT)) > 2 * 24
        for params in (
            SamplingParams(temperature=0, max_tokens=8, logprobs=0),
            SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=8, logprobs=0),
        ):
            alone = _run(llm, [PROMPT], params)[0]
            batched = _run(llm, [*OTHERS, PROMPT, *OTHERS], params)[len(OTHERS)]
            assert alone == batched, params
    finally:
        llm.shutdown()
