"""Train asyncllm's default model, `asyncllm-tiny`, from nothing but this machine.

The corpus is the Python standard library's own source (PSF licence, present wherever
Python is), so the model can be rebuilt and redistributed without a network. The
script trains a byte-level BPE tokenizer, then a small LlamaForCausalLM on the CPU,
measures held-out loss on files it never trained on, and writes a Hugging Face model
directory that transformers and asyncllm both load.

    python tools/train_default_model.py                    # the shipped model
    python tools/train_default_model.py --quick --out DIR  # a one-minute smoke run

Every random choice flows from `--seed`: file split, batch sampling and weight init.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "python" / "asyncllm" / "default_model" / "asyncllm-tiny"

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
# Folders of the stdlib left out of the corpus: test suites (large, repetitive
# fixtures) and whatever a user installed into site-packages (not PSF-licensed).
SKIP_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
SOURCE = "the CPython standard library's .py files (test suites and site-packages excluded)"
LICENCE = (
    "Python Software Foundation License Version 2 (PSF-2.0): the CPython standard "
    "library source, https://docs.python.org/3/license.html"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "### {{ message['role'] }}\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}### assistant\n{% endif %}"
)
SAMPLE_PROMPTS = (
    "def add(a, b):",
    "import os\n\n\ndef read_lines(path):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
)


@dataclass(frozen=True)
class Recipe:
    """What the run is: everything that changes the weights."""

    seed: int = 0
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 2500
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    heldout_every: int = 50  # one file in this many is held out (by a hash of its path)
    max_files: int = 0  # 0 = every file; the quick mode takes a few
    # Mixed precision: bf16 matmuls (1.6x faster on a CPU with AVX512-BF16), fp32
    # master weights, optimizer state and loss; the saved weights are fp32.
    autocast_bf16: bool = True


QUICK = Recipe(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    seq_len=64,
    batch_size=4,
    steps=8,
    warmup_steps=2,
    heldout_every=4,
    max_files=24,
)


# ----------------------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path, recipe: Recipe) -> tuple[list[Path], list[Path]]:
    """The stdlib's .py files, split into train and held-out by a hash of the path,
    so the split does not depend on which other files exist."""
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS.intersection(rel.parts):
            continue
        try:
            path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        files.append(path)
    if recipe.max_files:
        files = files[: recipe.max_files]
    train, heldout = [], []
    for path in files:
        digest = hashlib.sha256(path.relative_to(root).as_posix().encode()).digest()
        (
            heldout if int.from_bytes(digest[:4], "little") % recipe.heldout_every == 0 else train
        ).append(path)
    if not train or not heldout:
        raise SystemExit(
            f"corpus split left nothing to train on or to hold out ({len(files)} files)"
        )
    return train, heldout


def manifest(root: Path, train: list[Path], heldout: list[Path]) -> dict:
    def entry(path: Path) -> dict:
        data = path.read_bytes()
        return {
            "path": path.relative_to(root).as_posix(),
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }

    return {
        "source": SOURCE,
        "python": platform.python_version(),
        "licence": LICENCE,
        "train": [entry(p) for p in train],
        "heldout": [entry(p) for p in heldout],
    }


# -------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    # Prompts start with BOS, as every training document does.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def token_stream(tok, texts: list[str]) -> np.ndarray:
    """Documents as one stream: BOS, the file's tokens, EOS — so the model learns
    where a document ends and emits EOS there."""
    encodings = tok.encode_batch(texts, add_special_tokens=True)
    eos = tok.token_to_id(EOS)
    parts = [np.asarray(e.ids + [eos], dtype=np.int32) for e in encodings]
    return np.concatenate(parts)


# ------------------------------------------------------------------------------ model


def build_model(recipe: Recipe, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.seq_len * 2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        torch_dtype="float32",
    )
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def lr_at(step: int, recipe: Recipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model, stream: np.ndarray, seq_len: int, max_windows: int = 256) -> float:
    """Mean next-token loss over consecutive non-overlapping windows of the held-out stream."""
    model.eval()
    n = min(max_windows, (len(stream) - 1) // seq_len)
    total, count = 0.0, 0
    for start in range(0, n, 16):
        rows = range(start, min(n, start + 16))
        x = torch.stack(
            [torch.from_numpy(stream[i * seq_len : (i + 1) * seq_len + 1]).long() for i in rows]
        )
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def unigram_loss(train: np.ndarray, heldout: np.ndarray, vocab: int) -> float:
    """Cross-entropy of a (add-one smoothed) unigram model fit on the train stream:
    the floor a model that learned nothing about context would reach."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout].mean())


def train(model, stream: np.ndarray, heldout: np.ndarray, recipe: Recipe, log_every: int):
    gen = torch.Generator().manual_seed(recipe.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    data = torch.from_numpy(stream).long()
    model.train()
    start = time.perf_counter()
    window_loss, window_start, history = 0.0, start, []
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        offsets = torch.randint(
            0, len(data) - recipe.seq_len - 1, (recipe.batch_size,), generator=gen
        )
        batch = torch.stack([data[o : o + recipe.seq_len + 1] for o in offsets.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.autocast_bf16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window_loss += loss.item()
        done = step + 1
        if done % log_every == 0 or done == recipe.steps:
            now = time.perf_counter()
            steps_in_window = (done - 1) % log_every + 1
            tok_s = steps_in_window * recipe.batch_size * recipe.seq_len / (now - window_start)
            mean = window_loss / steps_in_window
            line = f"step {done:5d}/{recipe.steps}  loss {mean:.3f}  {tok_s:,.0f} tok/s"
            if done % (log_every * 10) == 0 or done == recipe.steps:
                held = heldout_loss(model, heldout, recipe.seq_len, max_windows=64)
                line += f"  held-out {held:.3f}"
                history.append(
                    {
                        "step": done,
                        "train_loss": window_loss / steps_in_window,
                        "heldout_loss": held,
                    }
                )
            print(line, flush=True)
            window_loss, window_start = 0.0, time.perf_counter()
    return time.perf_counter() - start, history


# ------------------------------------------------------------------------------ write


def tokenizer_config(tok, model_max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def greedy_samples(model, tok, max_new_tokens: int) -> list[dict]:
    model.eval()
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append({"prompt": prompt, "completion": tok.decode(gen[0, ids.shape[1] :].tolist())})
    return out


def model_card(report: dict) -> str:
    r, c = report["recipe"], report["corpus"]
    samples = "\n".join(
        f"Prompt:\n\n```python\n{s['prompt']}\n```\n\n"
        f"Greedy completion ({report['sample_tokens']} tokens):"
        f"\n\n```python\n{s['prompt']}{s['completion']}\n```\n"
        for s in report["samples"]
    )
    return f"""# asyncllm-tiny

asyncllm's default model: a {report["parameters"] / 1e6:.1f} M-parameter LlamaForCausalLM
trained from scratch on the Python standard library's source, so that asyncllm
generates text offline with no download. It writes Python-shaped text; it is not an
assistant and knows nothing beyond the stdlib's code and docstrings. Use it to try
asyncllm, in tests and benchmarks where a real (not random) model matters, and as a
fixture — not for answers.

## Corpus and licence
- Source: {c["source"]}, Python {c["python"]}.
- {c["train_files"]} files ({c["train_tokens"]:,} tokens) for training,
  {c["heldout_files"]} held out ({c["heldout_tokens"]:,} tokens); the split is a
  hash of each file's path. `corpus.json` lists every file with its size and SHA-256.
- Licence: {LICENCE}. The weights and tokenizer are derived from that text and
  are distributed under the same terms.

## Model
| | |
|---|---|
| architecture | LlamaForCausalLM, tied embeddings, GQA |
| parameters | {report["parameters"]:,} |
| vocabulary | {report["vocab_size"]} (byte-level BPE; `{BOS}`, `{EOS}`, `{PAD}`) |
| hidden / MLP / layers | {r["hidden_size"]} / {r["intermediate_size"]} / {r["num_layers"]} |
| heads / KV heads | {r["num_heads"]} / {r["num_kv_heads"]} |
| context | {report["max_position_embeddings"]} (trained on {r["seq_len"]}-token windows) |
| weights | float32 safetensors (trained with bf16 autocast) |

Documents are `{BOS}` + file + `{EOS}`; the tokenizer adds `{BOS}` to every prompt.

## Training
```
{report["command"]}
```
{r["steps"]} steps of {r["batch_size"]} × {r["seq_len"]} tokens (AdamW, lr {r["lr"]},
cosine to 10 %, {r["warmup_steps"]} warm-up steps, seed {r["seed"]}) on
{report["threads"]} CPU threads: {report["train_seconds"] / 60:.1f} min,
{report["tokens_per_second"]:,.0f} tokens/s, torch {report["torch"]}.

## Held-out loss (nats per token)
| | loss |
|---|---|
| this model | {report["heldout_loss"]:.3f} |
| unigram baseline (fit on the training tokens) | {report["unigram_loss"]:.3f} |

## Samples
{samples}"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model directory to write")
    parser.add_argument("--quick", action="store_true", help="tiny corpus, tiny model, a few steps")
    parser.add_argument("--steps", type=int, help="override the recipe's step count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)

    recipe = QUICK if args.quick else Recipe()
    overrides = {"seed": args.seed}
    if args.steps is not None:
        overrides["steps"] = args.steps
    recipe = Recipe(**{**asdict(recipe), **overrides})
    log_every = max(1, min(args.log_every, recipe.steps // 4 or 1))
    torch.set_num_threads(args.threads)

    root = stdlib_root()
    train_files, heldout_files = corpus_files(root, recipe)
    train_texts = [p.read_text(encoding="utf-8") for p in train_files]
    heldout_texts = [p.read_text(encoding="utf-8") for p in heldout_files]
    print(
        f"corpus: {len(train_files)} train / {len(heldout_files)} held-out files from {root}",
        flush=True,
    )

    t0 = time.perf_counter()
    tok = train_tokenizer(train_texts, recipe.vocab_size)
    train_stream = token_stream(tok, train_texts)
    heldout_stream = token_stream(tok, heldout_texts)
    print(
        f"tokenizer: {tok.get_vocab_size()} tokens in {time.perf_counter() - t0:.1f} s; "
        f"{len(train_stream):,} train / {len(heldout_stream):,} held-out tokens",
        flush=True,
    )

    model = build_model(recipe, tok)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters", flush=True)
    seconds, history = train(model, train_stream, heldout_stream, recipe, log_every)
    held = heldout_loss(model, heldout_stream, recipe.seq_len)
    unigram = unigram_loss(train_stream, heldout_stream, tok.get_vocab_size())
    print(f"held-out loss {held:.3f} (unigram baseline {unigram:.3f})", flush=True)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    max_len = model.config.max_position_embeddings
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(tok, max_len), indent=2) + "\n"
    )
    (out / "corpus.json").write_text(
        json.dumps(manifest(root, train_files, heldout_files), indent=1) + "\n"
    )

    sample_tokens = 8 if args.quick else 48
    report = {
        "recipe": asdict(recipe),
        "command": " ".join(
            [
                "python",
                "tools/train_default_model.py",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "parameters": params,
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": max_len,
        "threads": args.threads,
        "torch": torch.__version__,
        "train_seconds": seconds,
        "tokens_per_second": recipe.steps * recipe.batch_size * recipe.seq_len / seconds,
        "heldout_loss": held,
        "unigram_loss": unigram,
        "history": history,
        "corpus": {
            "source": SOURCE,
            "python": platform.python_version(),
            "train_files": len(train_files),
            "heldout_files": len(heldout_files),
            "train_tokens": int(len(train_stream)),
            "heldout_tokens": int(len(heldout_stream)),
        },
        "sample_tokens": sample_tokens,
        "samples": greedy_samples(model, tok, sample_tokens),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "README.md").write_text(model_card(report))
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
