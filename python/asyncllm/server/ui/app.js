// The page: three tabs (chat and completions at ./, the dashboard at ./dashboard).
import { modelName, setUpKeyForm } from "./api.js";
import { setUpChat } from "./chat.js";
import { setUpCompletions } from "./completions.js";
import { startDashboard, stopDashboard } from "./dashboard.js";

const TABS = ["chat", "completions", "dashboard"];

function show(tab, push) {
  for (const name of TABS) {
    document.getElementById(name).hidden = name !== tab;
    document.querySelector(`.tab[data-tab=${name}]`).classList.toggle("active", name === tab);
  }
  if (tab === "dashboard") startDashboard();
  else stopDashboard();
  if (push) {
    // relative to the page, so a path prefix in front of it is kept
    const here = location.pathname.endsWith("/dashboard") ? "dashboard" : "";
    const there = tab === "dashboard" ? "dashboard" : "";
    if (here !== there) history.pushState({ tab }, "", there || "./");
    else history.replaceState({ tab }, "");
  }
  document.body.dataset.tab = tab;
}

function tabOfLocation() {
  if (history.state?.tab) return history.state.tab;
  return location.pathname.endsWith("/dashboard") ? "dashboard" : "chat";
}

async function main() {
  setUpKeyForm();
  for (const button of document.querySelectorAll(".tab")) {
    button.addEventListener("click", () => show(button.dataset.tab, true));
  }
  window.addEventListener("popstate", () => show(tabOfLocation(), false));
  const model = modelName();
  setUpChat(model);
  setUpCompletions(model);
  show(tabOfLocation(), false);
  try {
    document.getElementById("model").textContent = await model;
  } catch (error) {
    document.getElementById("model").textContent = String(error.message ?? error);
  }
}

main();
