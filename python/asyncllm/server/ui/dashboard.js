// The dashboard tab: /metrics polled every second, drawn as live charts.
import { apiFetch, errorText } from "./api.js";
import { LineChart } from "./charts.js";
import { buckets, parseMetrics, quantile, total } from "./metrics.js";

const P = "asyncllm:";
const WINDOW = 10; // latency percentiles over the last this many polls
let charts = null;
let timer = null;
let loop = 0; // the current polling loop (a stopped one ends at its next turn)
let previous = null; // {time, prompt, generation}
const latencyHistory = []; // bucket snapshots, oldest first

const count = (v) => (v >= 100 ? v.toFixed(0) : v.toFixed(v >= 10 ? 1 : 2));
const percent = (v) => (100 * v).toFixed(v < 0.01 ? 2 : 1) + "%";
const ms = (v) => (1000 * v).toFixed(v >= 0.1 ? 0 : 1) + " ms";
const bytes = (v) => (v >= 1 << 20 ? (v / (1 << 20)).toFixed(1) + " MiB" : (v / 1024).toFixed(1) + " KiB");

function makeCharts() {
  const root = document.getElementById("charts");
  return {
    tokens: new LineChart(root, "chart-tokens", "Tokens/s", ["prompt", "generation"], count),
    requests: new LineChart(root, "chart-requests", "Requests", ["running", "waiting"], count),
    kv: new LineChart(root, "chart-kv", "KV-cache usage", ["used"], percent),
    ttft: new LineChart(root, "chart-ttft", "Time to first token", ["p50", "p90", "p99"], ms),
    itl: new LineChart(root, "chart-itl", "Inter-token latency", ["p50", "p90", "p99"], ms),
    grammar: new LineChart(root, "chart-grammar", "Grammar cache", ["core", "front end"], bytes),
  };
}

function percentiles(now, index) {
  const old = latencyHistory.length >= WINDOW ? latencyHistory[0][index] : null;
  return [0.5, 0.9, 0.99].map((q) => quantile(q, now[index], old));
}

function update(samples, time) {
  const prompt = total(samples, P + "prompt_tokens_total");
  const generation = total(samples, P + "generation_tokens_total");
  let rates = [null, null];
  if (previous) {
    const seconds = (time - previous.time) / 1000;
    rates = [(prompt - previous.prompt) / seconds, (generation - previous.generation) / seconds];
  }
  previous = { time, prompt, generation };
  charts.tokens.push(rates);
  charts.requests.push([
    total(samples, P + "num_requests_running"),
    total(samples, P + "num_requests_waiting"),
  ]);
  charts.kv.push([total(samples, P + "kv_cache_usage_perc")]);
  const now = [
    buckets(samples, P + "time_to_first_token_seconds"),
    buckets(samples, P + "inter_token_latency_seconds"),
  ];
  charts.ttft.push(percentiles(now, 0));
  charts.itl.push(percentiles(now, 1));
  latencyHistory.push(now);
  if (latencyHistory.length > WINDOW) latencyHistory.shift();
  charts.grammar.push([
    total(samples, P + "grammar_cache_bytes"),
    total(samples, P + "frontend_grammar_cache_bytes"),
  ]);
}

async function poll(mine) {
  if (mine !== loop) return;
  const status = document.getElementById("dash-status");
  try {
    const response = await apiFetch("metrics");
    if (!response.ok) throw new Error(await errorText(response));
    update(parseMetrics(await response.text()), performance.now());
    status.textContent = "Updated " + new Date().toLocaleTimeString();
  } catch (error) {
    status.textContent = String(error.message ?? error);
  }
  if (mine === loop) timer = setTimeout(() => poll(mine), 1000);
}

export function startDashboard() {
  charts ??= makeCharts();
  if (timer === null) {
    timer = 0;
    poll(++loop);
  }
}

export function stopDashboard() {
  if (timer) clearTimeout(timer);
  timer = null;
  loop++;
}
