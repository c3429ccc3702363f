"""The server's page in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`) driven by selenium, against `asyncllm serve` running the shipped
asyncllm-tiny behind an API key, with the qwen3 reasoning parser. One server and one
browser for the module; the tests run in order on the same page: the key asked for
once, a streamed reply growing in the DOM, a reply stopped mid-stream (the server
aborts it), forced output with `<script>` and `<think>` rendered as text with the
reasoning apart, a forced tool call, a raw completion, the dashboard's charts under
load, the dashboard's Prometheus parsing, and the page behind a reverse proxy that
serves it under /llm. A screenshot of each tab goes to the test's output folder.
Skipped where the browser is absent."""

from __future__ import annotations

import contextlib
import http.server
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from server_process import Server, get_text, post

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.common.by import By  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="no headless browser: install Debian's chromium and chromium-driver",
    ),
]

API_KEY = "sk-browser-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SCRIPT = "<script>window.pwned = 1</script><b>bold</b>"
FORCED = f"<think>thinking it over</think>{SCRIPT}"


def wait_for(check, timeout: float = 30.0, every: float = 0.05):
    """check()'s first truthy value within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {check}")
        time.sleep(every)


def metric(server: Server, name: str, label: str = "") -> float:
    """The sum of the /metrics samples of `name` (with `label`, e.g. 'a="b"')."""
    text = get_text(server.url + "/metrics", AUTH)
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + "{") and label in line
    )


def running(server: Server) -> float:
    return metric(server, "asyncllm:num_requests_running")


def aborted(server: Server) -> float:
    return metric(server, "asyncllm:request_success_total", 'finished_reason="abort"')


@contextlib.contextmanager
def load(server: Server, streams: int, max_tokens: int) -> Iterator[None]:
    """`streams` clients sending completions one after another until the block ends."""
    stop = threading.Event()
    body = {"model": "asyncllm-tiny", "prompt": "load", "max_tokens": max_tokens}
    body["ignore_eos"] = True

    def client() -> None:
        while not stop.is_set():
            post(server.url + "/v1/completions", body, AUTH)

    threads = [threading.Thread(target=client) for _ in range(streams)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui-browser")
    srv = Server(
        tmp / "server.log",
        "--api-key",
        API_KEY,
        "--reasoning-parser",
        "qwen3",
        # FORCED covers the whole output, the reasoning included
        "--structured-outputs-config",
        '{"enable_in_reasoning": true}',
    )
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def browser(server):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"]:
        options.add_argument(arg)
    options.add_argument("--disable-dev-shm-usage")
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(CHROMEDRIVER))
    driver.implicitly_wait(0)
    driver.get(server.url + "/")
    yield driver
    driver.quit()


def by_id(driver, name: str):
    return driver.find_element(By.ID, name)


def fill(driver, name: str, value: str) -> None:
    field = by_id(driver, name)
    field.clear()
    if value:
        field.send_keys(value)


def last_reply(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def send(driver, text: str, max_tokens: int, extra: dict | None = None) -> None:
    fill(driver, "max-tokens", str(max_tokens))
    by_id(driver, "extra").clear()
    if extra:
        driver.execute_script(
            "document.getElementById('extra').value = arguments[0]", json.dumps(extra)
        )
    fill(driver, "prompt", text)
    by_id(driver, "send").click()


def test_key_is_asked_once_and_kept_in_the_session(browser):
    wait_for(lambda: by_id(browser, "key-form").is_displayed())
    by_id(browser, "key-input").send_keys(API_KEY)
    by_id(browser, "key-form").find_element(By.TAG_NAME, "button").click()
    wait_for(lambda: by_id(browser, "model").text == "asyncllm-tiny")
    assert browser.execute_script("return sessionStorage.getItem('asyncllm.apiKey')") == API_KEY
    assert API_KEY not in browser.page_source  # nowhere in the document itself


def test_reply_streams_into_the_page(browser):
    # every length the reply's text takes in the DOM, as the browser renders it
    browser.execute_script(
        """window.lengths = [];
        new MutationObserver(() => {
          const r = [...document.querySelectorAll('.msg.assistant .content')].at(-1);
          if (r) window.lengths.push(r.textContent.length);
        }).observe(document.getElementById('messages'),
                   {childList: true, subtree: true, characterData: true});"""
    )
    send(browser, "Tell me a story.", 48, {"ignore_eos": True})
    reply = wait_for(lambda: last_reply(browser))
    wait_for(lambda: reply.get_attribute("data-state") == "done", 60)
    lengths = browser.execute_script("return window.lengths")
    assert len(set(lengths)) >= 3, lengths  # it grew in steps, not all at once
    assert lengths == sorted(lengths)
    assert reply.get_attribute("data-finish") == "length"
    assert reply.find_element(By.CLASS_NAME, "content").text
    assert by_id(browser, "regenerate").is_enabled()


def stop_a_reply(browser) -> str:
    """Sends a long reply, clicks stop once it streams, and gives how it finished."""
    by_id(browser, "clear").click()  # a reply of 400 tokens leaves no room for more
    where = by_id(browser, "stop").rect
    send(browser, "Keep going.", 400, {"ignore_eos": True})  # the context is 512 tokens
    wait_for(lambda: last_reply(browser).get_attribute("data-state") == "streaming")
    reply = last_reply(browser)
    wait_for(lambda: len(reply.find_element(By.CLASS_NAME, "content").text) > 20)
    assert by_id(browser, "stop").rect == where  # the streaming text never moves it
    by_id(browser, "stop").click()
    wait_for(lambda: reply.get_attribute("data-state") == "done")
    return reply.get_attribute("data-finish")


def test_stop_aborts_the_request_on_the_server(browser, server):
    """The model writes ~1,000 tokens/s alone, so eight other streams share the engine
    meanwhile (the reply then takes a second or more); the server counts the reply
    aborted. The click still races the reply's end: on a busy 2-CPU CI box the
    browser's click once reached the server after the 400th token. A reply that ended
    by its length before the click arrived is no evidence either way, so the test
    tries again (three times at most); a stop button that never aborts still fails."""
    before = aborted(server)
    finishes = []
    with load(server, 8, 400):
        wait_for(lambda: running(server) >= 4, 30, 0.1)
        for _ in range(3):
            finishes.append(stop_a_reply(browser))
            if finishes[-1] != "length":
                break
        assert finishes[-1] == "stopped", finishes
        assert not by_id(browser, "chat-error").is_displayed()
        wait_for(lambda: aborted(server) == before + 1, 10, 0.1)
    wait_for(lambda: running(server) == 0, 30, 0.1)
    assert aborted(server) == before + 1  # the load itself ran to its end


def test_model_output_is_text_and_reasoning_is_apart(browser, tmp_path):
    by_id(browser, "clear").click()
    send(browser, "Say something risky.", 64, {"structured_outputs": {"choice": [FORCED]}})
    reply = wait_for(lambda: last_reply(browser))
    wait_for(lambda: reply.get_attribute("data-state") == "done", 60)
    content = reply.find_element(By.CLASS_NAME, "content")
    assert content.get_attribute("textContent") == SCRIPT
    assert content.find_elements(By.CSS_SELECTOR, "*") == []  # no element came from it
    assert browser.execute_script("return window.pwned") is None
    reasoning = reply.find_element(By.CLASS_NAME, "reasoning-text")
    assert reasoning.is_displayed() and reasoning.text == "thinking it over"
    send(browser, "Now as JSON.", 64, {"structured_outputs": {"choice": ['{"a": [1, 2]}']}})
    reply = last_reply(browser)
    wait_for(lambda: reply.get_attribute("data-state") == "done", 60)
    assert reply.find_element(By.CSS_SELECTOR, ".content pre.json").text == json.dumps(
        {"a": [1, 2]}, indent=2
    )
    browser.save_screenshot(str(tmp_path / "chat.png"))
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    forced = {"type": "function", "function": {"name": "get_weather"}}
    send(browser, "Weather?", 64, {"tools": [tool], "tool_choice": forced})
    reply = last_reply(browser)
    wait_for(lambda: reply.get_attribute("data-state") == "done", 60)
    call = reply.find_element(By.CSS_SELECTOR, "pre.tool-call").text
    assert call == "get_weather(" + json.dumps({"city": "Paris"}, indent=2) + ")"


def test_completions_tab(browser, tmp_path):
    browser.find_element(By.CSS_SELECTOR, ".tab[data-tab=completions]").click()
    fill(browser, "completion-prompt", "Once upon a time")
    fill(browser, "completion-max-tokens", "32")
    by_id(browser, "complete").click()
    wait_for(lambda: by_id(browser, "completion-text").text)
    wait_for(lambda: by_id(browser, "complete").is_enabled())
    assert by_id(browser, "completion-echo").text == "Once upon a time"
    browser.save_screenshot(str(tmp_path / "completions.png"))


def test_dashboard_charts_follow_a_load(browser, server, tmp_path):
    browser.find_element(By.CSS_SELECTOR, ".tab[data-tab=dashboard]").click()
    assert browser.current_url == server.url + "/dashboard"
    with load(server, 3, 64):
        value = "#chart-tokens .value[data-series=generation]"

        def generation_rate() -> float:
            text = browser.find_element(By.CSS_SELECTOR, value).get_attribute("data-value")
            return float(text) if text else 0.0

        assert wait_for(generation_rate, 30, 0.2) > 0
        wait_for(lambda: browser.find_element(By.CSS_SELECTOR, "#chart-itl .value").text != "–")

        def samples() -> int:
            chart = browser.find_element(By.ID, "chart-tokens")
            return int(chart.get_attribute("data-samples"))

        first = samples()
        wait_for(lambda: samples() >= first + 4, 30, 0.2)  # a few seconds of lines to see
        assert generation_rate() > 0
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
    assert Path(tmp_path / "dashboard.png").stat().st_size > 0


def test_metrics_parsing_and_percentiles_in_the_page(browser):
    """The dashboard's own reading of Prometheus text (ui/metrics.js), run in the page:
    series summed over engines, a histogram's percentiles from two snapshots."""
    text = "\n".join(
        [
            "# HELP asyncllm:num_requests_running Requests in the running batch.",
            'asyncllm:num_requests_running{engine="0",model_name="a \\"b\\""} 2.0',
            'asyncllm:num_requests_running{engine="1",model_name="a \\"b\\""} 3.0',
            'asyncllm:itl_bucket{le="0.1",model_name="m"} 5.0',
            'asyncllm:itl_bucket{le="0.5",model_name="m"} 10.0',
            'asyncllm:itl_bucket{le="+Inf",model_name="m"} 10.0',
        ]
    )
    got = browser.execute_async_script(
        """const [text, done] = arguments;
        import(new URL("ui/metrics.js", document.baseURI)).then((m) => {
          const samples = m.parseMetrics(text);
          const now = m.buckets(samples, "asyncllm:itl");
          const before = [[0.1, 1], [0.5, 2], [Infinity, 2]];
          done({
            running: m.total(samples, "asyncllm:num_requests_running"),
            label: samples["asyncllm:num_requests_running"][0].labels.model_name,
            p50: m.quantile(0.5, now, null),
            p90: m.quantile(0.9, now, null),
            p50_since: m.quantile(0.5, now, before),
            none: m.quantile(0.5, now, now),
          });
        });""",
        text,
    )
    assert got["running"] == 5 and got["label"] == 'a "b"'
    assert got["p50"] == pytest.approx(0.1) and got["p90"] == pytest.approx(0.42)
    # 8 new observations since: 4 up to 0.1 s, 4 in (0.1, 0.5]: the median is 0.1
    assert got["p50_since"] == pytest.approx(0.1)
    assert got["none"] is None


class _StripPrefix(http.server.BaseHTTPRequestHandler):
    """A reverse proxy that serves the server under /llm and strips the prefix, as
    one in front of `asyncllm serve --root-path /llm` would (HTTP/1.0: one request
    per connection, the answer streamed through as it comes)."""

    target = ""

    def _forward(self) -> None:
        if not self.path.startswith("/llm/"):
            self.send_error(404)
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host",)}
        req = urllib.request.Request(
            self.target + self.path[len("/llm") :], body, headers, method=self.command
        )
        try:
            resp = urllib.request.urlopen(req, timeout=30)
        except urllib.error.HTTPError as exc:
            resp = exc
        with resp:
            self.send_response(resp.status)
            for name, value in resp.headers.items():
                if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(name, value)
            self.end_headers()
            while chunk := resp.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()

    do_GET = do_POST = _forward

    def log_message(self, *args: object) -> None:
        pass


def test_page_works_behind_a_path_prefix(browser, server, tmp_path):
    handler = type("Proxy", (_StripPrefix,), {"target": server.url})
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{proxy.server_address[1]}/llm/"
    try:
        browser.get(base)  # another origin: its own sessionStorage, the key asked again
        wait_for(lambda: by_id(browser, "key-form").is_displayed())
        by_id(browser, "key-input").send_keys(API_KEY)
        by_id(browser, "key-form").find_element(By.TAG_NAME, "button").click()
        wait_for(lambda: by_id(browser, "model").text == "asyncllm-tiny")
        send(browser, "Hello through the proxy.", 8)
        reply = wait_for(lambda: last_reply(browser))
        wait_for(lambda: reply.get_attribute("data-state") == "done", 60)
        assert reply.get_attribute("data-finish") in ("stop", "length")
        assert not by_id(browser, "chat-error").is_displayed()
        browser.find_element(By.CSS_SELECTOR, ".tab[data-tab=dashboard]").click()
        assert browser.current_url == base + "dashboard"
        wait_for(lambda: by_id(browser, "dash-status").text.startswith("Updated"))
        browser.refresh()  # the dashboard's own address loads the page too
        wait_for(lambda: by_id(browser, "dashboard").is_displayed())
    finally:
        proxy.shutdown()
        proxy.server_close()
