"""Greedy continuations of SmolLM2-135M-Instruct (GGUF Q4_1) by transformers, the
reference the engine must equal: written to tests/fixtures/smollm2_greedy.json,
which tests/test_gguf_smollm2.py reads (so the tests need not load transformers'
model, ~30 s here), and checked against the engine by `--check`. Beside it,
tests/fixtures/smollm2_scores.json: transformers' log-probability of every token
of a few texts (the scoring API's reference, tests/test_gguf_scores.py), one of
them a held-out paragraph whose perplexity faster kernels must keep.

transformers dequantizes the GGUF to float32 with its own GGUF loader
(`load_gguf_checkpoint`: the q/k rows un-permuted, the tied head), and renders the
chat template of the GGUF's metadata.

    python tools/smollm2_reference.py            # write the fixture
    python tools/smollm2_reference.py --check    # the engine on all 32 prompts vs it
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from fetch_smollm2 import SHA256, fetch  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "smollm2_greedy.json"
SCORES = ROOT / "tests" / "fixtures" / "smollm2_scores.json"
# Scored texts: the last is the held-out paragraph (written for this file, so in
# no training set) whose perplexity is checked.
SCORED_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Water boils at 100 degrees Celsius at sea level, and at a lower temperature on "
    "a mountain, where the air pressure is lower.",
    "On the morning the ferry stopped running, the island's baker opened an hour "
    "early. She had flour for a week, yeast for two, and a radio that only caught "
    "the weather from the mainland. By noon the queue reached the harbour wall, and "
    "people who had not spoken in years were trading jokes about the price of "
    "bread. The mayor arrived last, carrying a basket of eggs from his own hens, "
    "and asked whether the ovens could run through the night. They could, she said, "
    "if someone kept the fire fed and nobody minded loaves shaped like boats.",
]
MAX_TOKENS = 16
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 7?",
    "Give me a name for a pet turtle.",
    "Translate 'good morning' into Spanish.",
    "What colour is the sky on a clear day?",
    "Write a Python function that adds two numbers.",
    "Why do cats purr?",
    "Name a planet in our solar system.",
    "What is the boiling point of water in Celsius?",
    "Suggest a title for a mystery novel.",
    "How many legs does a spider have?",
    "What does HTML stand for?",
    "Tell me a fun fact about octopuses.",
    "What is the opposite of 'ancient'?",
    "Describe a sunset in five words.",
    "Who painted the Mona Lisa?",
    "What is the largest ocean on Earth?",
    "Give one tip for learning a language.",
    "What is a synonym for 'happy'?",
    "How do you make a cup of tea?",
    "What year did the first person walk on the Moon?",
    "Write a short greeting for a birthday card.",
    "What is the square root of 81?",
    "Name three primary colours.",
    "What is the chemical symbol for gold?",
    "Recommend a book for a long flight.",
    "What is machine learning?",
    "Say hello in French.",
]


def reference_model(path: Path) -> tuple[Any, Any]:
    """transformers' tokenizer and float32 model of the GGUF (its GGUF loader,
    without `from_pretrained`'s need for accelerate)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return tok, model.eval()


def write_fixture(path: Path) -> None:
    tok, model = reference_model(path)
    cases = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        completion = out[0, len(ids) :].tolist()
        text = tok.decode(completion, skip_special_tokens=True)
        cases.append(
            {"messages": messages, "prompt_token_ids": ids, "completion": completion, "text": text}
        )
        print(prompt, "->", repr(text), flush=True)
    # one line per case: a readable diff when the references change
    lines = [f'{{"gguf_sha256": "{SHA256}", "max_tokens": {MAX_TOKENS}, "cases": [']
    lines += [json.dumps(c, ensure_ascii=False) + "," for c in cases]
    lines[-1] = lines[-1].removesuffix(",")
    FIXTURE.write_text("\n".join(lines) + "\n]}\n", encoding="utf-8")
    print(f"wrote {FIXTURE}")


def write_scores(path: Path) -> None:
    """transformers' log-probability of each token (after the first) of each text."""
    tok, model = reference_model(path)
    texts = []
    for text in SCORED_TEXTS:
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        scores = logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        texts.append({"text": text, "token_ids": ids, "logprobs": scores})
    body = {"gguf_sha256": SHA256, "texts": texts}
    SCORES.write_text(json.dumps(body, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {SCORES}")


def check(path: Path) -> int:
    """The engine (float32) on every case of the fixture; the number that differ."""
    from asyncllm import LLM, SamplingParams

    cases = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]
    t0 = time.perf_counter()
    with LLM(model=str(path), dtype="float32") as llm:
        prompts = [{"prompt_token_ids": c["prompt_token_ids"]} for c in cases]
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    bad = 0
    for case, out in zip(cases, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        if got != case["completion"]:
            bad += 1
            print(f"DIFFERS: {case['messages'][0]['content']!r}: {got} vs {case['completion']}")
    print(f"{len(cases) - bad}/{len(cases)} equal ({time.perf_counter() - t0:.1f} s)")
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="check the engine against it")
    parser.add_argument("--scores-only", action="store_true", help="write only the scores")
    args = parser.parse_args()
    path = fetch()
    if args.check:
        raise SystemExit(1 if check(path) else 0)
    if not args.scores_only:
        write_fixture(path)
    write_scores(path)


if __name__ == "__main__":
    main()
