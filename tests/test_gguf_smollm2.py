"""SmolLM2-135M-Instruct from its GGUF (Q4_1 layers, a Q8_0 embedding tied to the
LM head): loaded with its weights kept in blocks, it continues chat prompts exactly
as transformers does on the same file (greedy, float32), through `LLM.chat` and
through the OpenAI-compatible server (whose echo + logprobs scores a text as
transformers does). The references are transformers' output, recorded by
tools/smollm2_reference.py in tests/fixtures/smollm2_greedy.json and
smollm2_scores.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.gguf_files import prepare_gguf, read_manifest
from asyncllm.models.fused_decode import unsupported
from asyncllm.models.gguf.layers import GGUFEmbedding, GGUFLinear
from asyncllm.models.hf_config import load_hf_config
from asyncllm.models.loader import load_model

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_greedy.json"
SCORES = Path(__file__).parent / "fixtures" / "smollm2_scores.json"
NUM_CASES = 8


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def test_config_and_layers_from_the_file(smollm2_gguf: Path) -> None:
    folder = prepare_gguf(smollm2_gguf)
    cfg = load_hf_config(folder)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == (49152, 100000.0, True)
    assert (folder / "chat_template.jinja").is_file()
    assert len(read_manifest(folder)["tensors"]) == 272
    model = load_model(folder, cfg, torch.float32, torch.device("cpu"))
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, GGUFLinear)
    assert layer.self_attn.qkv_proj.qtypes == ("Q4_1",)  # q, k and v fused: one block matrix
    assert isinstance(layer.mlp.gate_up_proj, GGUFLinear)
    assert isinstance(model.embed_tokens, GGUFEmbedding) and model.embed_tokens.qtype == "Q8_0"
    # the tied head computes on the embedding's blocks, not on a copy
    assert model.logits_head.part0.data_ptr() == model.embed_tokens.raw.data_ptr()
    held = sum(b.numel() * b.element_size() for b in model.buffers() if b.dtype == torch.uint8)
    held += sum(p.numel() * p.element_size() for p in model.parameters())
    assert held < 1.05 * smollm2_gguf.stat().st_size  # blocks, not float weights
    # the fused float decode step reads float weights: it declines, by name
    assert unsupported(model) == "a GGUFEmbedding embedding"


def test_greedy_chat_equals_transformers(smollm2_gguf: Path, reference: dict) -> None:
    cases = reference["cases"][:NUM_CASES]
    params = SamplingParams(max_tokens=reference["max_tokens"], temperature=0)
    with LLM(model=str(smollm2_gguf), dtype="float32", max_model_len=512) as llm:
        outs = llm.chat([case["messages"] for case in cases], params, use_tqdm=False)
    for case, out in zip(cases, outs, strict=True):
        # the chat template and the tokenizer from the metadata: transformers' prompt
        assert list(out.prompt_token_ids) == case["prompt_token_ids"]
        assert list(out.outputs[0].token_ids) == case["completion"], case["messages"]


def test_chat_through_the_server_with_the_openai_client(
    smollm2_gguf: Path, reference: dict, tmp_path: Path
) -> None:
    openai = pytest.importorskip("openai")
    from server_process import Server

    case = reference["cases"][0]
    server = Server(
        tmp_path / "server.log", str(smollm2_gguf), "--dtype", "float32", "--max-model-len", "512"
    )
    scored = json.loads(SCORES.read_text(encoding="utf-8"))["texts"][2]
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=str(smollm2_gguf),
            messages=case["messages"],
            max_tokens=reference["max_tokens"],
            temperature=0,
        )
        # the scoring API over HTTP: echo + logprobs gives each prompt token's logprob
        echo = client.completions.create(
            model=str(smollm2_gguf),
            prompt=scored["token_ids"],
            max_tokens=1,
            temperature=0,
            echo=True,
            logprobs=0,
        )
    finally:
        server.stop()
    assert reply.choices[0].message.content == case["text"]
    n = len(scored["token_ids"])
    got = echo.choices[0].logprobs.token_logprobs[:n]
    assert got[0] is None  # nothing predicts the first token
    worst = max(abs(a - b) for a, b in zip(got[1:], scored["logprobs"], strict=True))
    assert worst <= 1e-3  # transformers' on the same file (tests/test_gguf_scores.py)
