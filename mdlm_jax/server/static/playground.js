// The playground: chat and fill-in-the-middle against this server's OpenAI
// API, streaming the diffusion drafts ("diffusing": each chunk carries the
// whole current draft, which replaces the last). Undecided positions arrive
// as MASK and are drawn as such, so the draft visibly sharpens; text a draft
// changed since the one before (revision: the model took back a token it had
// drafted) is marked as revised.
"use strict";

const MASK = "\u2591";
const EFFORTS = ["instant", "low", "medium", "high"];
const $ = (id) => document.getElementById(id);
const history = [];  // the chat so far, as the API takes it
let modelId = null;

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function settings() {
  return {
    reasoning_effort: EFFORTS[Number($("effort").value)],
    max_tokens: Number($("max-tokens").value),
    temperature: Number($("temperature").value),
    seed: Number($("seed").value),
  };
}

// The kind of each character of `text`: undecided (MASK), revised (decided
// in `prev` too, but as something else) or text.
function kinds(text, prev) {
  const was = prev ? [...prev] : [];
  return [...text].map((c, i) => c === MASK ? "undecided"
      : (i < was.length && was[i] !== MASK && was[i] !== c ? "revised" : "text"));
}

// Draws `text` into `el`: runs of MASK as undecided, what changed since the
// draft `prev` as revised, the rest as text.
function drawDraft(el, text, prev) {
  el.replaceChildren();
  const chars = [...text], kind = kinds(text, prev);
  for (let i = 0; i < chars.length;) {
    let j = i;
    while (j < chars.length && kind[j] === kind[i]) j++;
    const run = chars.slice(i, j).join("");
    if (kind[i] === "text") {
      el.appendChild(document.createTextNode(run));
    } else {
      const span = document.createElement("span");
      span.className = kind[i];
      span.textContent = run;
      el.appendChild(span);
    }
    i = j;
  }
}

function setStatus(state, text) {
  $("status").dataset.state = state;
  $("status").textContent = text || state;
  $("status").className = state === "error" ? "error" : "";
}

function showStats(usage, seconds, drafts) {
  $("stats-drafts").textContent = String(drafts);
  if (!usage) return;
  $("stats-tokens").textContent = String(usage.completion_tokens);
  $("stats-tps").textContent = seconds > 0 ? (usage.completion_tokens / seconds).toFixed(1) : "–";
  $("stats-passes").textContent = usage.forward_passes !== undefined ? String(usage.forward_passes) : "–";
}

// POSTs a streaming request and calls onDraft(whole draft text) per chunk.
// Resolves with {text, usage, seconds, drafts}.
async function streamDrafts(path, body, pick, onDraft) {
  const t0 = performance.now();
  const r = await fetch(path, {method: "POST", headers: headers(),
                               body: JSON.stringify({...body, stream: true, diffusing: true,
                                                     stream_options: {include_usage: true}})});
  if (!r.ok) {
    let message = `${r.status}`;
    try { message += ": " + (await r.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", text = "", usage = null, drafts = 0;
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        const choice = (chunk.choices || [])[0];
        const draft = choice ? pick(choice) : null;
        if (typeof draft === "string" && (draft.length || !choice.finish_reason)) {
          text = draft;
          drafts += 1;
          onDraft(text);
        }
      }
    }
  }
  return {text, usage, seconds: (performance.now() - t0) / 1000, drafts};
}

function busy(on) {
  for (const id of ["chat-send", "fim-send", "chat-clear"]) $(id).disabled = on;
}

async function sendChat() {
  const content = $("chat-input").value;
  if (!content.trim()) return;
  history.push({role: "user", content});
  $("chat-input").value = "";
  const user = document.createElement("div");
  user.className = "msg user";
  user.textContent = content;
  const answer = document.createElement("div");
  answer.className = "msg assistant";
  $("chat-log").append(user, answer);
  busy(true);
  setStatus("running", "diffusing…");
  try {
    let prev = null;
    const out = await streamDrafts("/v1/chat/completions", {model: modelId, messages: history, ...settings()},
                                   (c) => c.delta && c.delta.content, (t) => { drawDraft(answer, t, prev); prev = t; });
    drawDraft(answer, out.text);
    answer.dataset.final = "true";
    history.push({role: "assistant", content: out.text});
    showStats(out.usage, out.seconds, out.drafts);
    setStatus("done");
  } catch (e) {
    history.pop();
    answer.textContent = String(e.message || e);
    answer.classList.add("error");
    setStatus("error", "error");
  } finally {
    busy(false);
  }
}

async function sendFim() {
  const prompt = $("fim-prefix").value, suffix = $("fim-suffix").value;
  $("fim-shown-prefix").textContent = prompt;
  $("fim-shown-suffix").textContent = suffix;
  const middle = $("fim-middle");
  delete middle.dataset.final;
  busy(true);
  setStatus("running", "diffusing…");
  try {
    let prev = null;
    const out = await streamDrafts("/v1/fim/completions", {model: modelId, prompt, suffix, ...settings()},
                                   (c) => c.text, (t) => { drawDraft(middle, t, prev); prev = t; });
    drawDraft(middle, out.text);
    middle.dataset.final = "true";
    showStats(out.usage, out.seconds, out.drafts);
    setStatus("done");
  } catch (e) {
    middle.textContent = String(e.message || e);
    setStatus("error", "error");
  } finally {
    busy(false);
  }
}

function selectTab(name) {
  for (const tab of ["chat", "fim"]) {
    $("tab-" + tab).setAttribute("aria-selected", String(tab === name));
    $("panel-" + tab).hidden = tab !== name;
  }
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", {headers: headers()});
    if (!r.ok) throw new Error(r.status === 401 ? "enter the API key" : `${r.status}`);
    const card = (await r.json()).data[0];
    modelId = card.id;
    $("model").textContent = `${card.id} · context ${card.context_length} tokens`;
  } catch (e) {
    $("model").textContent = String(e.message || e);
  }
}

$("effort").addEventListener("input", () => { $("effort-name").textContent = EFFORTS[Number($("effort").value)]; });
$("tab-chat").addEventListener("click", () => selectTab("chat"));
$("tab-fim").addEventListener("click", () => selectTab("fim"));
$("chat-send").addEventListener("click", sendChat);
$("fim-send").addEventListener("click", sendFim);
$("chat-clear").addEventListener("click", () => { history.length = 0; $("chat-log").replaceChildren(); });
$("chat-input").addEventListener("keydown", (e) => { if (e.key === "Enter" && e.ctrlKey) sendChat(); });
$("api-key").value = localStorage.getItem("mdlm_jax_api_key") || "";
$("api-key").addEventListener("change", () => { localStorage.setItem("mdlm_jax_api_key", $("api-key").value); loadModel(); });
loadModel();
