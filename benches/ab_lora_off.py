"""The hot path without adapters, before and after LoRA: 64 greedy streams of 64
tokens on the "micro" model, in-process, LoRA off; prints the median of 3 runs'
tokens/s. Run it from each tree with that tree's python, alternating:

    (cd OLD && OLD/.venv/bin/python NEW/benches/ab_lora_off.py)
    .venv/bin/python benches/ab_lora_off.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import build_model  # noqa: E402

from asyncllm import LLM, SamplingParams  # noqa: E402

root = "/tmp/ab_base_models"
model = build_model("micro", root)
llm = LLM(str(model), multiprocess=False, dtype="float32", max_num_seqs=64)
p = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
prompts = [{"prompt_token_ids": [1, 450, 4996, 17354 + i]} for i in range(64)]
llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)
rates = []
for _ in range(3):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, p, use_tqdm=False)
    rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
print(sorted(rates)[1])
llm.shutdown()
