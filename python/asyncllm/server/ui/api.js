// Talking to the server: relative URLs only (the page works behind a path prefix),
// the API key asked for once on a 401 and kept in this tab's sessionStorage.
const KEY = "asyncllm.apiKey";
let keyWaiters = [];

export function apiKey() {
  return sessionStorage.getItem(KEY);
}

function askForKey() {
  const form = document.getElementById("key-form");
  form.hidden = false;
  document.getElementById("key-input").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

export function setUpKeyForm() {
  const form = document.getElementById("key-form");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const input = document.getElementById("key-input");
    sessionStorage.setItem(KEY, input.value);
    input.value = "";
    form.hidden = true;
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((resolve) => resolve());
  });
}

// fetch(path) with the key when one is set; on a 401, ask for a key and try again.
export async function apiFetch(path, options = {}) {
  for (;;) {
    const headers = new Headers(options.headers || {});
    const key = apiKey();
    if (key) headers.set("Authorization", "Bearer " + key);
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    sessionStorage.removeItem(KEY);
    await askForKey();
  }
}

// The error message of a failed response (OpenAI's error JSON, or its text).
export async function errorText(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return `HTTP ${response.status}: ${body.error?.message ?? text}`;
  } catch {
    return `HTTP ${response.status}: ${text}`;
  }
}

// POST a JSON body and call onEvent(data) for each server-sent event until [DONE].
export async function streamJSON(path, body, signal, onEvent) {
  const response = await apiFetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw new Error(await errorText(response));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new Error(parsed.error.message ?? JSON.stringify(parsed.error));
        onEvent(parsed);
      }
    }
  }
}

// The first served model's name.
export async function modelName() {
  const response = await apiFetch("v1/models");
  if (!response.ok) throw new Error(await errorText(response));
  const body = await response.json();
  return body.data[0].id;
}

// A new element with a class and (always as text, never as HTML) its content.
export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}
