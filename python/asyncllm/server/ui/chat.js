// The chat tab: a conversation streamed from v1/chat/completions. Model text is
// always written with textContent (never as HTML); reasoning (reasoning_content)
// is shown apart from the answer; tool calls and JSON answers as formatted JSON.
import { el, streamJSON } from "./api.js";

const history = []; // {role, content} sent back to the server each turn
let running = null; // the AbortController of the reply being streamed
let model = null;

const $ = (id) => document.getElementById(id);

function messageView(role, text) {
  const node = el("div", `msg ${role}`);
  node.append(el("div", "role", role));
  const reasoning = el("details", "reasoning");
  reasoning.hidden = true;
  reasoning.open = true;
  reasoning.append(el("summary", "", "reasoning"), el("div", "reasoning-text"));
  node.append(reasoning, el("div", "content", text), el("div", "meta"));
  $("messages").append(node);
  followEnd();
  return node;
}

// Keep the newest text in view while it streams (unless the reader scrolled up).
function followEnd() {
  const box = $("messages");
  if (box.scrollHeight - box.scrollTop - box.clientHeight < 80) box.scrollTop = box.scrollHeight;
}

// JSON text shown formatted, or null when it is not JSON.
function formatted(text) {
  const trimmed = text.trim();
  if (!trimmed.startsWith("{") && !trimmed.startsWith("[")) return null;
  try {
    return JSON.stringify(JSON.parse(trimmed), null, 2);
  } catch {
    return null;
  }
}

function numberOf(id) {
  const value = $(id).value;
  return value === "" ? undefined : Number(value);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = {
    model: model,
    messages: messages.concat(history),
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberOf("temperature"),
    top_p: numberOf("top-p"),
    max_tokens: numberOf("max-tokens"),
  };
  const extra = $("extra").value.trim();
  if (extra) Object.assign(body, JSON.parse(extra)); // a bad JSON is reported below
  return body;
}

function applyDelta(view, state, delta) {
  if (delta.reasoning_content) {
    state.reasoning += delta.reasoning_content;
    const box = view.querySelector(".reasoning");
    box.hidden = false;
    box.querySelector(".reasoning-text").textContent = state.reasoning;
  }
  if (delta.content) {
    state.content += delta.content;
    view.querySelector(".content").textContent = state.content;
  }
  followEnd();
  for (const call of delta.tool_calls || []) {
    const slot = (state.tools[call.index ?? 0] ??= { name: "", arguments: "" });
    if (call.function?.name) slot.name += call.function.name;
    if (call.function?.arguments) slot.arguments += call.function.arguments;
  }
}

function finish(view, state, reason) {
  const json = formatted(state.content);
  if (json !== null) {
    view.querySelector(".content").replaceChildren(el("pre", "json", json));
  }
  for (const call of state.tools) {
    const args = formatted(call.arguments) ?? call.arguments;
    view.querySelector(".meta").before(el("pre", "json tool-call", `${call.name}(${args})`));
  }
  const parts = [reason ? `finish: ${reason}` : ""];
  if (state.usage) parts.push(`${state.usage.completion_tokens} tokens`);
  view.querySelector(".meta").textContent = parts.filter(Boolean).join(" · ");
  view.dataset.state = "done";
  view.dataset.finish = reason || "";
  followEnd();
}

async function reply() {
  const state = { content: "", reasoning: "", tools: [], usage: null };
  const view = messageView("assistant", "");
  view.dataset.state = "streaming";
  $("chat-error").hidden = true;
  running = new AbortController();
  setBusy(true);
  let reason = null;
  try {
    model = await modelPromise;
    await streamJSON("v1/chat/completions", requestBody(), running.signal, (chunk) => {
      if (chunk.usage) state.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        applyDelta(view, state, choice.delta || {});
        if (choice.finish_reason) reason = choice.finish_reason;
      }
    });
  } catch (error) {
    if (error.name === "AbortError") reason = "stopped";
    else showError(error);
  }
  finish(view, state, reason);
  const message = { role: "assistant", content: state.content };
  if (state.tools.length) {
    message.tool_calls = state.tools.map((call, i) => ({
      id: `call_${i}`,
      type: "function",
      function: { name: call.name, arguments: call.arguments },
    }));
  }
  history.push(message);
  running = null;
  setBusy(false);
}

function showError(error) {
  $("chat-error").textContent = String(error.message ?? error);
  $("chat-error").hidden = false;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || history.length === 0;
}

function send() {
  const text = $("prompt").value;
  if (!text.trim() || running) return;
  $("prompt").value = "";
  history.push({ role: "user", content: text });
  messageView("user", text);
  reply();
}

function regenerate() {
  if (running || !history.length || history.at(-1).role !== "assistant") return;
  history.pop();
  $("messages").lastElementChild.remove();
  reply();
}

let modelPromise = null;

export function setUpChat(modelNamePromise) {
  modelPromise = modelNamePromise;
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => running?.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", () => {
    running?.abort();
    history.length = 0;
    $("messages").replaceChildren();
    setBusy(false);
  });
}
