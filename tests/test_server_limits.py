"""Every server input limit and timeout, against a real `asyncllm serve` (the
shipped asyncllm-tiny) with small limits: the status, the error naming the field
and the flag without echoing the input, and slow clients (raw sockets) cut off
without holding an admission slot."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from server_process import Server, get_text, http_status, post

pytestmark = pytest.mark.timeout(180)

API_KEY = "sk-limits"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_SEQS = 24
LIMITS = {
    "--max-request-body-bytes": "65536",
    "--max-prompt-chars": "2000",
    "--max-prompt-tokens": "500",
    "--max-prompts-per-request": "4",
    "--max-n": "24",
    "--max-stop-strings": "2",
    "--max-stop-string-chars": "10",
    "--max-logit-bias": "3",
    "--max-stop-token-ids": "3",
    "--max-chat-messages": "3",
    "--max-header-bytes": "4096",
    "--max-response-bytes": "16000000",
    "--header-timeout": "2",
    "--body-timeout": "2",
    "--stream-idle-timeout": "2",
    "--max-connections": "40",
    "--max-concurrent-requests": str(MAX_SEQS),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    flags = [x for kv in LIMITS.items() for x in kv]
    os.environ["ASYNCLLM_API_KEY"] = API_KEY  # the key is not on the command line
    try:
        srv = Server(tmp / "server.log", "--served-model-name", "tiny", *flags)
    finally:
        del os.environ["ASYNCLLM_API_KEY"]
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-3000:]


def completions(server: Server, body: dict) -> tuple[int, dict]:
    return post(server.url + "/v1/completions", body, AUTH)


def chat(server: Server, body: dict) -> tuple[int, dict]:
    return post(server.url + "/v1/chat/completions", body, AUTH)


def running(server: Server) -> float:
    for line in get_text(server.url + "/metrics", AUTH).splitlines():
        if line.startswith("asyncllm:num_requests_running"):
            return float(line.split()[-1])
    raise AssertionError("no num_requests_running in /metrics")


def raw(server: Server, data: bytes, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", server.port))
    if data:
        sock.sendall(data)
    return sock


def read_all(sock: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out


def request_head(path: str, body_len: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {body_len}\r\n{extra}\r\n"
    ).encode()


LONG = "z" * 3000
FIELD_LIMITS = [
    ("completions", {"prompt": LONG}, "prompt", "--max-prompt-chars"),
    ("completions", {"prompt": ["a"] * 5}, "prompt", "--max-prompts-per-request"),
    ("completions", {"prompt": [5] * 501}, "prompt", "--max-prompt-tokens"),
    ("completions", {"prompt": "a", "n": 25}, "n", "--max-n"),
    ("completions", {"prompt": "a", "stop": ["x", "y", "z"]}, "stop", "--max-stop-strings"),
    ("completions", {"prompt": "a", "stop": LONG}, "stop", "--max-stop-string-chars"),
    (
        "completions",
        {"prompt": "a", "logit_bias": {str(i): 1 for i in range(4)}},
        "logit_bias",
        "--max-logit-bias",
    ),
    (
        "completions",
        {"prompt": "a", "stop_token_ids": [1, 2, 3, 4]},
        "stop_token_ids",
        "--max-stop-token-ids",
    ),
    (
        "completions",
        {"prompt": [[5] * 490] * 4, "n": 24, "echo": True, "logprobs": 20, "max_tokens": 5},
        "max_tokens",
        "--max-response-bytes",
    ),
    (
        "chat",
        {"messages": [{"role": "user", "content": "a"}] * 4},
        "messages",
        "--max-chat-messages",
    ),
    ("chat", {"messages": [{"role": "user", "content": LONG}]}, "messages", "--max-prompt-chars"),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "n": 25}, "n", "--max-n"),
]


@pytest.mark.parametrize(("endpoint", "body", "param", "flag"), FIELD_LIMITS)
@pytest.mark.parametrize("stream", [False, True])
def test_each_size_limit_names_the_field_and_flag(server, endpoint, body, param, flag, stream):
    send = completions if endpoint == "completions" else chat
    status, reply = send(server, {**body, "stream": stream})
    error = reply["error"]
    assert status in (400, 413), reply
    assert error["param"] == param and flag in error["message"]
    assert LONG not in error["message"] and len(json.dumps(reply)) < 1000


def test_tokenize_and_detokenize_are_bounded(server):
    status, reply = post(server.url + "/tokenize", {"prompt": LONG}, AUTH)
    assert status == 400 and "--max-prompt-chars" in reply["error"]["message"]
    status, reply = post(server.url + "/detokenize", {"tokens": [5] * 501}, AUTH)
    assert status == 413 and reply["error"]["param"] == "tokens"
    status, reply = post(server.url + "/detokenize", {"tokens": [10**9]}, AUTH)
    assert status == 400 and reply["error"]["param"] == "tokens"


def test_body_limit_before_and_while_reading(server):
    # declared too large: answered before a byte of the body is sent
    sock = raw(server, request_head("/v1/completions", 10**9))
    head = read_all(sock)
    assert head.startswith(b"HTTP/1.1 413") and b"--max-request-body-bytes" in head
    # chunked, no Content-Length: counted as it streams in
    sock = raw(
        server,
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n".encode(),
    )
    chunk = b"a" * 16384
    try:
        for _ in range(8):
            sock.sendall(b"%x\r\n%b\r\n" % (len(chunk), chunk))
    except OSError:
        pass  # the server may close while we still send
    assert read_all(sock).startswith(b"HTTP/1.1 413")


def test_slow_headers_are_cut_off(server):
    # part of the headers, then silence: 408 and closed after --header-timeout
    start = time.monotonic()
    sock = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert read_all(sock).startswith(b"HTTP/1.1 408")
    assert time.monotonic() - start < 20
    # a connection that sends nothing at all
    assert read_all(raw(server, b"")).startswith(b"HTTP/1.1 408")
    # headers that never end: 431 once past --max-header-bytes
    sock = raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\n")
    try:
        for i in range(100):
            sock.sendall(b"X-Pad-%d: %b\r\n" % (i, b"a" * 100))
    except OSError:
        pass
    reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 431")
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]  # OpenAI's shape here too
    assert "--max-header-bytes" in error["message"] and error["code"] == 431
    # a whole header section over the limit in one packet
    sock = raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
    reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 431") and b"--max-header-bytes" in reply


def test_a_body_that_never_comes_holds_no_slot(server):
    body = json.dumps({"prompt": "a", "max_tokens": 1}).encode()
    socks = [raw(server, request_head("/v1/completions", len(body))) for _ in range(MAX_SEQS)]
    # every would-be slot is "taken" by a client that sent only headers, yet
    # a real request runs: admission happens after the body is read
    status, reply = completions(server, {"prompt": "a", "max_tokens": 1})
    assert status == 200, reply
    for sock in socks:
        reply = read_all(sock)
        assert reply.startswith(b"HTTP/1.1 408") and b"--body-timeout" in reply


def test_client_leaving_before_its_body_is_not_an_error(server):
    before = server.log.read_text()
    sock = raw(server, request_head("/v1/completions", 1000) + b'{"prompt": ')
    time.sleep(0.3)
    sock.close()
    assert completions(server, {"prompt": "a", "max_tokens": 1})[0] == 200
    new = server.log.read_text()[len(before) :]
    assert "ERROR" not in new and "Traceback" not in new


def test_admission_counts_sequences(server):
    status, reply = completions(server, {"prompt": ["a", "b"], "n": 13, "max_tokens": 1})
    assert status == 400 and "--max-concurrent-requests" in reply["error"]["message"]
    body = {"prompt": "a", "n": MAX_SEQS, "max_tokens": 250, "ignore_eos": True, "stream": True}
    data = json.dumps(body).encode()
    sock = raw(server, request_head("/v1/completions", len(data)) + data)
    first = sock.recv(4096)  # the stream has started: its 8 sequences hold every slot
    assert first.startswith(b"HTTP/1.1 200")
    status, reply = completions(server, {"prompt": "a", "max_tokens": 1})
    assert status == 429 and "sequences" in reply["error"]["message"]
    sock.close()  # the client goes away: the request is aborted, its slots freed
    deadline = time.monotonic() + 60
    while completions(server, {"prompt": "a", "max_tokens": 1})[0] == 429:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _max_send_buffer() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/tcp_wmem").read().split()[2])
    except (OSError, IndexError, ValueError):
        return 4 << 20


@pytest.mark.skipif(_max_send_buffer() > 5 << 20, reason="the kernel may buffer the whole response")
def test_a_stream_never_read_is_aborted_and_frees_its_slots(server):
    # a prompt-only stream (max_tokens 0): the engine finishes at once, but the
    # response (24 echoes with 20 logprobs per token, ~7 MB) outgrows the
    # kernel's and the transport's buffers for a client that never reads, so the
    # stream would wait on it forever
    body = {
        "prompt": list(range(10, 490)),
        "n": MAX_SEQS,
        "max_tokens": 0,
        "echo": True,
        "logprobs": 20,
        "stream": True,
    }
    data = json.dumps(body).encode()
    sock = raw(server, request_head("/v1/completions", len(data)) + data, rcvbuf=1024)
    deadline = time.monotonic() + 120
    while "has not read its response" not in server.log.read_text():
        assert time.monotonic() < deadline, "the stalled stream was never cut off"
        time.sleep(0.2)
    while completions(server, {"prompt": "a", "max_tokens": 1})[0] == 429:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert running(server) == 0
    sock.close()


def test_connection_cap(server):
    socks = [raw(server, b"") for _ in range(int(LIMITS["--max-connections"]) + 1)]
    replies = []
    for sock in socks:
        sock.settimeout(0.5)
        try:
            replies.append(sock.recv(4096))
        except TimeoutError:
            replies.append(b"")
    assert any(r.startswith(b"HTTP/1.1 503") and b"--max-connections" in r for r in replies)
    for sock in socks:
        sock.close()
    time.sleep(0.5)
    assert http_status(server.url + "/health") == 200


@pytest.mark.parametrize("stream", [False, True])
def test_parameters_that_fail_after_fan_out_are_a_400_up_front(server, stream):
    status, reply = completions(
        server, {"prompt": "a", "seed": 2**64 - 1, "n": 2, "max_tokens": 1, "stream": stream}
    )
    assert status == 400 and reply["error"]["param"] == "seed"
    status, reply = completions(
        server, {"prompt": "a", "stop_token_ids": [10**6], "max_tokens": 1, "stream": stream}
    )
    assert status == 400 and reply["error"]["param"] == "stop_token_ids"
    assert "SamplingParams" not in reply["error"]["message"]


def test_api_key_from_env_models_and_reset_prefix_cache(server):
    assert http_status(server.url + "/v1/models") == 401
    models = json.loads(get_text(server.url + "/v1/models", AUTH))["data"]
    assert [(m["id"], m["root"]) for m in models] == [("tiny", "tiny")]  # not the local path
    status, _ = post(server.url + "/reset_prefix_cache", {}, {})
    assert status == 401
    status, reply = post(server.url + "/reset_prefix_cache", {}, AUTH)
    assert status == 200 and reply == {"reset": True}


def test_max_tokens_zero_with_echo_scores_the_prompt(server):
    prompt = "def add(a, b):"
    status, tok = post(server.url + "/tokenize", {"prompt": prompt}, AUTH)
    assert status == 200
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2, "stream": stream}
        if stream:
            text, lp, finish = _stream_completion(server, body)
        else:
            status, reply = completions(server, body)
            assert status == 200, reply
            choice = reply["choices"][0]
            text, lp, finish = choice["text"], choice["logprobs"], choice["finish_reason"]
            assert reply["usage"]["completion_tokens"] == 0
        assert text == prompt and finish == "length"
        assert len(lp["tokens"]) == tok["count"]  # the prompt's tokens, no generated one
        assert lp["token_logprobs"][0] is None and all(x < 0 for x in lp["token_logprobs"][1:])
    status, reply = completions(server, {"prompt": prompt, "max_tokens": 0})
    assert status == 400 and reply["error"]["param"] == "max_tokens"


def test_token_id_echo_text_tokens_and_offsets_agree(server):
    status, tok = post(server.url + "/tokenize", {"prompt": "x = 1\nprint(x)"}, AUTH)
    ids = tok["tokens"]
    assert status == 200 and len(ids) > 3
    body = {"prompt": ids, "max_tokens": 4, "echo": True, "logprobs": 3, "seed": 0}
    status, reply = completions(server, body)
    assert status == 200, reply
    choice = reply["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith("".join(lp["tokens"][: len(ids)]))
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert choice["text"][offset : offset + len(token)] == token
    # top_logprobs: the 3 most likely plus the sampled token when not among them
    for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:], strict=True):
        assert 3 <= len(top) <= 4 and token in top


def test_streamed_bad_request_is_a_400_not_an_error_event(server):
    status, reply = chat(
        server,
        {"messages": [{"role": "user", "content": "a"}], "stream": True, "temperature": -1},
    )
    assert status == 400 and reply["error"]["param"] == "temperature"


def _stream_completion(server: Server, body: dict) -> tuple[str, dict, str]:
    req = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **AUTH},
    )
    text, finish = "", ""
    lp: dict = {"tokens": [], "token_logprobs": []}
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp.read().decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            if choice["logprobs"]:
                lp["tokens"] += choice["logprobs"]["tokens"]
                lp["token_logprobs"] += choice["logprobs"]["token_logprobs"]
    return text, lp, finish


def test_bad_limit_flags_are_refused():
    out = subprocess.run(
        [sys.executable, "-m", "asyncllm.cli", "serve", "--max-n", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "--max-n" in out.stderr
