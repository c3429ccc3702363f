"""The OpenAI-compatible server as a real process on 127.0.0.1, driven by the
official `openai` client: outputs equal the engine's for the same seed, usage and
logprobs shapes, every error status, abort on disconnect, /health, /metrics,
graceful SIGTERM and `asyncllm bench serving`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import socket
import time
from pathlib import Path

import pytest

from asyncllm import LLM, EngineArgs, SamplingParams
from asyncllm.cli.args import ENGINE_HELP, add_engine_args, engine_args_from
from asyncllm.cli.main import main
from server_process import Server, get_text, http_status, post
from tiny_models import make_tiny_model

openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

pytestmark = pytest.mark.timeout(120)

API_KEY = "sk-test-key"
MODEL = "tiny"
MAX_CONCURRENT = 4
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_server(model_dir: Path, log: Path, *extra: str) -> Server:
    """The test model served as MODEL, in fp32."""
    return Server(log, str(model_dir), "--dtype", "float32", "--served-model-name", MODEL, *extra)


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def scrape(server: Server) -> dict[str, float]:
    """Every sample of /metrics by name (labels dropped: one model)."""
    samples = {}
    for family in parser.text_string_to_metric_families(get_text(server.url + "/metrics", AUTH)):
        for s in family.samples:
            key = s.name
            if "finished_reason" in s.labels:
                key += "{" + s.labels["finished_reason"] + "}"
            if "le" not in s.labels:
                samples[key] = s.value
    return samples


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", tokenizer="llama-2")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE)
    srv = tiny_server(
        model_dir,
        tmp / "server.log",
        "--chat-template",
        str(template),
        "--api-key",
        API_KEY,
        "--max-concurrent-requests",
        str(MAX_CONCURRENT),
    )
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(str(model_dir), multiprocess=False, dtype="float32")
    yield llm
    llm.shutdown()


def test_completions_match_the_engine(client, reference):
    kw = dict(temperature=0.8, seed=7, max_tokens=8)
    want = reference.generate(["Hello, my name is"], SamplingParams(**kw), use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt="Hello, my name is", **kw)
    assert got.choices[0].text == want.outputs[0].text
    assert got.choices[0].finish_reason == "length"
    assert got.object == "text_completion" and got.model == MODEL
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 8
    assert got.usage.total_tokens == got.usage.prompt_tokens + 8

    stream = client.completions.create(
        model=MODEL,
        prompt="Hello, my name is",
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_the_engine(client, reference):
    messages = [{"role": "user", "content": "Say something."}]
    text = "<s><|user|>Say something.\n<|assistant|>"  # TEMPLATE, rendered by hand
    ids = reference.get_tokenizer().encode(text, add_special_tokens=False)
    kw = dict(temperature=1.0, seed=3, max_tokens=6)
    want = reference.generate([ids], SamplingParams(**kw), use_tqdm=False)[0].outputs[0].text

    got = client.chat.completions.create(model=MODEL, messages=messages, **kw)
    assert got.choices[0].message.content == want
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 6

    stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_and_logprobs_shapes(client):
    out = client.completions.create(
        model=MODEL, prompt="The sky", n=2, max_tokens=5, logprobs=3, seed=1, echo=True
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 10
    for c in out.choices:
        assert c.text.startswith("The sky")
        lp = c.logprobs
        assert (
            len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        )
        assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
        # the 3 most likely, plus the chosen token when it is not among them (as OpenAI)
        for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True):
            assert 3 <= len(top) <= 4 and token in top
        # text, tokens and offsets describe the same string
        assert "".join(lp.tokens[1:]) == c.text[lp.text_offset[1] :]
        assert lp.text_offset == sorted(lp.text_offset)

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(chat.choices) == 2
    for c in chat.choices:
        assert len(c.logprobs.content) == 4
        for entry in c.logprobs.content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_error_statuses(server, client):
    url = server.url
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    assert bad.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.APIStatusError) as too_long:
        client.completions.create(model=MODEL, prompt=[5] * 2000, max_tokens=1)
    assert too_long.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5000)
    assert bad.value.body["param"] == "max_tokens"

    bad_key = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    assert http_status(url + "/v1/models") == 401
    assert http_status(url + "/metrics") == 401
    assert http_status(url + "/health") == 200  # open without a key

    status, body = post(url + "/v1/completions", {"prompt": "x", "n": 0}, AUTH)
    assert status == 400 and body["error"]["param"] == "n"
    # ... and it keeps serving
    assert (
        client.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens
        == 1
    )


def test_disconnect_aborts_and_limit_answers_429(server, client):
    before = scrape(server)
    streams = [
        client.completions.create(
            model=MODEL, prompt="Once", max_tokens=900, stream=True, extra_body={"ignore_eos": True}
        )
        for _ in range(MAX_CONCURRENT)
    ]
    for s in streams:
        next(iter(s))  # each request is running
    assert scrape(server)["asyncllm:num_requests_running"] == MAX_CONCURRENT
    with pytest.raises(openai.RateLimitError) as limited:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert limited.value.response.headers["retry-after"]
    for s in streams:
        s.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while True:
        after = scrape(server)
        if after["asyncllm:num_requests_running"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert after["asyncllm:num_requests_running"] == 0
    assert after["asyncllm:num_requests_waiting"] == 0
    assert after["asyncllm:kv_cache_usage_perc"] == 0.0
    aborted = after.get("asyncllm:request_success_total{abort}", 0)
    assert aborted - before.get("asyncllm:request_success_total{abort}", 0) == MAX_CONCURRENT
    # the slots are free again
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices


def test_disconnect_mid_request_aborts(server):
    body = json.dumps({"prompt": "Once", "max_tokens": 900, "ignore_eos": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}"
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 10
        while scrape(server)["asyncllm:num_requests_running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    # the socket is closed: a non-streamed request is aborted too
    deadline = time.monotonic() + 10
    while scrape(server)["asyncllm:num_requests_running"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert scrape(server)["asyncllm:kv_cache_usage_perc"] == 0.0


def test_metrics_count_requests(server, client):
    before = scrape(server)
    client.completions.create(
        model=MODEL, prompt="Count me", max_tokens=3, extra_body={"ignore_eos": True}
    )
    after = scrape(server)
    assert (
        after["asyncllm:generation_tokens_total"] - before["asyncllm:generation_tokens_total"] == 3
    )
    assert (
        after["asyncllm:request_success_total{length}"]
        == before["asyncllm:request_success_total{length}"] + 1
    )
    assert (
        after["asyncllm:e2e_request_latency_seconds_count"]
        > before["asyncllm:e2e_request_latency_seconds_count"]
    )
    assert after["asyncllm:time_to_first_token_seconds_count"] > 0
    assert after["asyncllm:prefix_cache_queries_total"] > 0
    # queue time is measured in the core's scheduler, once per admitted request
    assert (
        after["asyncllm:request_queue_time_seconds_count"]
        == before["asyncllm:request_queue_time_seconds_count"] + 1
    )
    # this request's queue time is part of its end-to-end time (arrival to finish)
    queued = (
        after["asyncllm:request_queue_time_seconds_sum"]
        - before["asyncllm:request_queue_time_seconds_sum"]
    )
    e2e = (
        after["asyncllm:e2e_request_latency_seconds_sum"]
        - before["asyncllm:e2e_request_latency_seconds_sum"]
    )
    assert 0.0 < queued <= e2e, (queued, e2e)


def test_models_tokenize_version(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    status, body = post(
        server.url + "/tokenize", {"prompt": "Hello", "add_special_tokens": False}, AUTH
    )
    assert status == 200 and body["count"] == len(body["tokens"])
    status, back = post(server.url + "/detokenize", {"tokens": body["tokens"]}, AUTH)
    assert status == 200 and back["prompt"] == "Hello"
    assert json.loads(get_text(server.url + "/version", AUTH))["version"]


def test_bench_serving_reports_figures(server, capsys):
    argv = ["bench", "serving", "--base-url", server.url, "--api-key", API_KEY]
    argv += ["--num-prompts", "4", "--output-len", "4", "--max-concurrency", "2", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 16
    assert result["ttft_ms"]["median"] > 0 and result["itl_ms"]["p99"] > 0


def test_no_template_then_sigterm_during_streaming(model_dir, tmp_path):
    # no grace period: the stream is aborted however fast the model decodes
    srv = tiny_server(model_dir, tmp_path / "server.log", "--shutdown-timeout", "0")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        assert "chat template" in bad.value.message
        children = srv.children()
        assert children  # the engine core
        stream = client.completions.create(
            model=MODEL, prompt="Once", max_tokens=900, stream=True, extra_body={"ignore_eos": True}
        )
        it = iter(stream)
        next(it)
        srv.proc.send_signal(signal.SIGTERM)
        rest = list(it)  # ends: aborted after the grace period
        assert rest[-1].choices[0].finish_reason == "abort"
        assert srv.proc.wait(30) == 0
        for pid in children:
            assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid)
    finally:
        srv.stop()


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_every_engine_arg_is_a_documented_flag():
    names = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    assert names == set(ENGINE_HELP)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["m", "--max-num-seqs", "8", "--no-enable-prefix-caching"])
    args = engine_args_from(ns)
    assert args.max_num_seqs == 8 and args.enable_prefix_caching is False


def test_bench_overhead_reports_the_core_gap(model_dir, capsys):
    argv = ["bench", "overhead", str(model_dir), "--num-streams", "16", "--output-len", "64"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steady_steps"] > 0
    assert 0 < result["schedule_us"] < result["gap_us"]
    assert result["output_token_throughput"] > 0
