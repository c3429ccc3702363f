"""Prometheus metrics, named as vLLM's dashboards expect with an `asyncllm:` prefix.

Per-request timings (time to first token, inter-token latency, end to end) are
measured here in the server, where each output reaches its consumer; the core's
state (running, waiting, KV-cache usage, prefix-cache and preemption counters) is
read from `AsyncLLM.get_stats()` when `/metrics` is scraped. A `RequestTimer` lives
for one request; its `on_output` runs once per streamed output, so it stays small.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

PREFIX = "asyncllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The *_created series double the exposition and no dashboard reads them.
disable_created_metrics()

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class ServerMetrics:
    """Every metric of one server, in a registry of its own."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        reg = self.registry

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(
                model_name
            )

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to the first generated token.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between two streamed outputs.", _ITL_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to finish.", _E2E_BUCKETS
        )
        self.prompt_len = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", _TOKEN_BUCKETS
        )
        self.generation_len = histogram(
            "request_generation_tokens", "Generated length of finished requests.", _TOKEN_BUCKETS
        )
        self.frontend_grammar_cache_bytes = Gauge(
            PREFIX + "frontend_grammar_cache_bytes",
            "Heap bytes held by the front end's cached compiled grammars (the engine "
            "core's are grammar_cache_bytes).",
            labels,
            registry=reg,
        ).labels(model_name)
        self.core = _CoreStatsCollector(model_name)
        reg.register(self.core)

    def success(self, finish_reason: str) -> Any:
        return self._success.labels(self.model_name, finish_reason)

    def start(self, num_prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, num_prompt_tokens)

    def render(self, core_stats: dict[str, Any] | None) -> bytes:
        """The exposition text, with the core's state from `core_stats` (None: the
        core did not answer; its gauges are left out)."""
        self.core.stats = core_stats
        return generate_latest(self.registry)


class RequestTimer:
    """Timings of one request (one prompt; all its n choices): created on arrival."""

    __slots__ = ("metrics", "arrival", "first", "last", "num_prompt_tokens", "num_tokens")

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.first = 0.0
        self.last = 0.0
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = 0

    def on_output(self, num_new_tokens: int) -> None:
        """One output with `num_new_tokens` new tokens (all choices) has arrived."""
        if not num_new_tokens:
            return
        now = time.perf_counter()
        if self.num_tokens == 0:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.num_tokens += num_new_tokens

    def on_finish(self, finish_reasons: list[str | None]) -> None:
        m = self.metrics
        now = time.perf_counter()
        m.e2e.observe(now - self.arrival)
        m.prompt_tokens.inc(self.num_prompt_tokens)
        m.generation_tokens.inc(self.num_tokens)
        m.prompt_len.observe(self.num_prompt_tokens)
        m.generation_len.observe(self.num_tokens)
        if self.num_tokens > 1:
            m.tpot.observe((self.last - self.first) / (self.num_tokens - 1))
        for reason in finish_reasons:
            m.success(reason or "abort").inc()


class _CoreStatsCollector(Collector):
    """The core's scheduler state as gauges and counters, from the stats fetched
    for this scrape."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] | None = None

    def describe(self) -> list[Metric]:
        return []  # names vary with what the core reports; nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if not stats:
            return
        # one series per engine core (label `engine`, as vLLM's), also with one core
        engines = [
            ([self.model_name, str(rank)], s)
            for rank, s in enumerate(stats.get("engines") or [stats])
        ]
        labels = ["model_name", "engine"]
        gauges = (
            ("num_requests_running", "num_running", "Requests in the running batch."),
            ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
            ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks in use."),
            (
                "grammar_cache_bytes",
                "grammar_cache_bytes",
                "Heap bytes held by the engine core's cached compiled grammars.",
            ),
            (
                "grammar_cache_entries",
                "grammar_cache_entries",
                "Compiled grammars in the engine core's cache.",
            ),
        )
        for name, key, doc in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for label, s in engines:
                if key in s:
                    g.add_metric(label, float(s[key]))
            if g.samples:
                yield g
        counters = (
            ("prefix_cache_queries", "Tokens looked up in the prefix cache."),
            ("prefix_cache_hits", "Prefix-cache lookups that hit."),
            ("num_preemptions", "Requests preempted by the scheduler."),
            ("spec_decode_num_drafts", "Speculative decoding: drafts verified."),
            ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."),
            ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."),
        )
        for key, doc in counters:
            c = CounterMetricFamily(PREFIX + key, doc, labels=labels)
            for label, s in engines:
                if key in s:
                    c.add_metric(label, float(s[key]))
            if c.samples:
                yield c
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: accepted draft tokens at each draft position.",
            labels=[*labels, "position"],
        )
        for label, s in engines:
            for pos, num in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos") or ()):
                per_pos.add_metric([*label, str(pos)], float(num))
        if per_pos.samples:
            yield per_pos
        yield from _lora_info(engines)
        h = HistogramMetricFamily(
            PREFIX + "request_queue_time_seconds",
            "Time from arrival to the scheduler's first run of a request.",
            labels=labels,
        )
        for label, s in engines:
            if "queue_time_cumulative" in s:  # measured in the core's scheduler
                bounds = [str(float(b)) for b in s["queue_time_buckets"]] + ["+Inf"]
                h.add_metric(
                    label,
                    buckets=list(zip(bounds, map(float, s["queue_time_cumulative"]), strict=True)),
                    sum_value=float(s["queue_time_sum"]),
                )
        if h.samples:
            yield h


def _lora_info(engines: list[tuple[list[str], dict[str, Any]]]) -> Iterator[Metric]:
    """vLLM's `vllm:lora_requests_info` (its name, labels, and the time as value):
    the adapters of running and waiting requests, when LoRA is on."""
    g = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on LoRA requests.",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    for _, s in engines:
        if "max_lora" in s:
            running, waiting = ",".join(s["lora_running"]), ",".join(s["lora_waiting"])
            g.add_metric([str(s["max_lora"]), running, waiting], time.time())
    if g.samples:
        yield g


class StatsLogger:
    """One log line every `interval` seconds while the server is busy."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._last_time = time.perf_counter()
        self._last_prompt = 0.0
        self._last_gen = 0.0

    def log(self, stats: dict[str, Any] | None) -> None:
        now = time.perf_counter()
        prompt = self.metrics.prompt_tokens._value.get()
        gen = self.metrics.generation_tokens._value.get()
        elapsed = max(now - self._last_time, 1e-9)
        running = (stats or {}).get("num_running", 0)
        waiting = (stats or {}).get("num_waiting", 0)
        if gen != self._last_gen or prompt != self._last_prompt or running or waiting:
            logger.info(
                "prompt throughput %.1f tok/s, generation throughput %.1f tok/s, "
                "running %d, waiting %d, KV cache %.1f%%",
                (prompt - self._last_prompt) / elapsed,
                (gen - self._last_gen) / elapsed,
                running,
                waiting,
                100.0 * float((stats or {}).get("kv_cache_usage", 0.0)),
            )
        self._last_time, self._last_prompt, self._last_gen = now, prompt, gen
