// The completions tab: a raw prompt streamed from v1/completions, shown as text.
import { streamJSON } from "./api.js";

const $ = (id) => document.getElementById(id);
let running = null;

async function complete(modelPromise) {
  const prompt = $("completion-prompt").value;
  $("completion-echo").textContent = prompt;
  $("completion-text").textContent = "";
  $("completion-error").hidden = true;
  running = new AbortController();
  $("complete").disabled = true;
  $("completion-stop").disabled = false;
  let text = "";
  try {
    const body = {
      model: await modelPromise,
      prompt,
      stream: true,
      max_tokens: Number($("completion-max-tokens").value) || undefined,
      temperature: Number($("completion-temperature").value),
    };
    await streamJSON("v1/completions", body, running.signal, (chunk) => {
      for (const choice of chunk.choices || []) {
        text += choice.text || "";
        $("completion-text").textContent = text;
      }
    });
  } catch (error) {
    if (error.name !== "AbortError") {
      $("completion-error").textContent = String(error.message ?? error);
      $("completion-error").hidden = false;
    }
  }
  running = null;
  $("complete").disabled = false;
  $("completion-stop").disabled = true;
}

export function setUpCompletions(modelPromise) {
  $("completion-form").addEventListener("submit", (event) => {
    event.preventDefault();
    if (!running) complete(modelPromise);
  });
  $("completion-stop").addEventListener("click", () => running?.abort());
}
