"""asyncllm-tiny, the shipped default model: transformers loads it, asyncllm runs it
exactly as transformers does, it learned something, and it is what asyncllm uses
when no model is named. Also: its training script still runs end to end."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from asyncllm import EngineArgs, SamplingParams
from asyncllm.default_model import DEFAULT_MODEL, default_model_path
from asyncllm.frontend.llm import LLM
from asyncllm.frontend.tokenizer import Tokenizer
from server_process import Server, get_text, post
from tiny_models import hf_greedy

REPO = Path(__file__).resolve().parent.parent
MODEL = default_model_path()
PROMPTS = [
    "def add(a, b):",
    "import os\n\n\ndef read_lines(path):",
    "class Stack:\n    def __init__(self):",
    "    for key, value in",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm():
    with LLM(multiprocess=False, dtype="float32") as llm:
        yield llm


def test_shipped_directory_is_complete_and_small():
    names = {p.name for p in MODEL.iterdir()}
    for required in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
        "corpus.json",
    ):
        assert required in names, f"{required} missing from {MODEL}"
    total = sum(p.stat().st_size for p in MODEL.iterdir())
    assert total <= 25 * 2**20, f"the shipped model takes {total / 2**20:.1f} MiB (limit 25)"
    config = json.loads((MODEL / "tokenizer_config.json").read_text())
    assert config["chat_template"]


def test_transformers_tokenizer_agrees_with_ours():
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(MODEL)
    ours = Tokenizer(MODEL)
    for prompt in PROMPTS:
        assert theirs(prompt)["input_ids"] == ours.encode(prompt)
        assert ours.encode(prompt)[0] == ours.bos_token_id


def test_greedy_equals_transformers(hf_model, llm):
    tok = Tokenizer(MODEL)
    prompts = [tok.encode(p) for p in PROMPTS]
    # min_tokens masks EOS exactly as min_new_tokens does, so both run the full length.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    expected = hf_greedy(MODEL, prompts, MAX_TOKENS, model=hf_model)
    for got, want in zip(ours, expected, strict=True):
        assert list(got) == want


def _heldout_texts() -> list[str]:
    """The held-out files the manifest names, where this interpreter's stdlib has the
    very same bytes (another Python version may have changed them)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    manifest = json.loads((MODEL / "corpus.json").read_text())
    texts = []
    for entry in manifest["heldout"]:
        path = root / entry["path"]
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]:
            texts.append(path.read_text(encoding="utf-8"))
    if not texts:
        pytest.skip(f"none of the held-out files is in this Python's stdlib at {root}")
    return texts


def test_heldout_loss_is_far_below_a_unigram_model(hf_model):
    tok = Tokenizer(MODEL)
    ids = [i for text in _heldout_texts() for i in tok.encode(text)]
    window = 256
    ids = ids[: window * 24 + 1]
    # The unigram baseline is fit on the held-out tokens themselves: the best any
    # model without context could do on them.
    counts: dict[int, int] = {}
    for i in ids[1:]:
        counts[i] = counts.get(i, 0) + 1
    n = len(ids) - 1
    unigram = -sum(c * math.log(c / n) for c in counts.values()) / n
    x = torch.tensor(ids[: n // window * window + 1])
    inputs = x[:-1].view(-1, window)
    targets = x[1:].view(-1, window)
    with torch.inference_mode():
        logits = hf_model(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )
    # Shipped model, Python 3.11: 3.24 against 5.75 nats per token.
    assert loss.item() < unigram - 1.5, (loss.item(), unigram)


def test_function_header_completes_with_an_indented_body(llm):
    out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=16))[0]
    text = out.outputs[0].text
    assert "\n    " in text, repr(text)


def test_a_stop_string_the_model_writes_ends_the_request(llm):
    params = SamplingParams(temperature=0.0, max_tokens=32, stop=["\n"])
    out = llm.generate(["def add(a, b):\n    "], params)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", "\n"), out
    assert "\n" not in out.text


def test_no_model_argument_means_the_default(caplog):
    with caplog.at_level("INFO", logger="asyncllm"):
        args = EngineArgs()
    assert Path(args.model) == MODEL
    assert any(DEFAULT_MODEL in r.getMessage() for r in caplog.records)
    assert Path(EngineArgs(model=DEFAULT_MODEL).model) == MODEL


def test_a_directory_named_like_the_default_wins(tmp_path, monkeypatch):
    (tmp_path / DEFAULT_MODEL).mkdir()
    monkeypatch.chdir(tmp_path)
    assert EngineArgs().model == DEFAULT_MODEL


def test_cli_generate_without_a_model():
    env = {**os.environ, "ASYNCLLM_LOG_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, "-m", "asyncllm.cli", "generate", "--prompt", "def add(a, b):"]
        + ["--max-tokens", "16", "--temperature", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), proc.stderr
    assert "built-in default model" in proc.stderr


def test_cli_serve_without_a_model(tmp_path):
    server = Server(tmp_path / "serve.log")
    try:
        models = [m["id"] for m in json.loads(get_text(server.url + "/v1/models"))["data"]]
        assert models == [DEFAULT_MODEL]
        body = {
            "model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": "Write a function."}],
            "max_tokens": 8,
            "temperature": 0,
        }
        status, chat = post(server.url + "/v1/chat/completions", body)
        assert status == 200, chat
        assert chat["usage"]["completion_tokens"] >= 1
        assert "built-in default model" in server.log.read_text()
    finally:
        assert server.stop() == 0, server.log.read_text()[-3000:]


def test_training_script_runs_in_quick_mode(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "model"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "train_default_model.py"),
            "--quick",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: ~10 s quiet, past 60 on a box loaded 5x its cores
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held-out loss" in proc.stdout
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer)
    report = json.loads((out / "training_report.json").read_text())
    assert math.isfinite(report["heldout_loss"])
    with LLM(str(out), multiprocess=False) as llm:
        got = llm.generate(["def f():"], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert len(got.outputs[0].token_ids) >= 1
