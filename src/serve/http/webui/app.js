// Picchio's chat page: streams answers from this server's own /v1/chat/completions.
// No libraries and no network beyond this server; conversations live in localStorage.
"use strict";

const STORE_CHATS = "picchio.chats";
const STORE_CURRENT = "picchio.current";
const STORE_KEY = "picchio.apiKey";
// What `picchio chat` puts in its system message (ChatSettings::opening), for the export.
const MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI.";
const KNOWLEDGE_CUTOFF = "2024-06";

const $ = (id) => document.getElementById(id);

let chats = [];
let currentId = null;
let running = null; // {controller} while an answer streams
let model = null; // {id, context_length}
let lastUsage = null;

// ---------- storage ----------

function loadChats() {
  try {
    const parsed = JSON.parse(localStorage.getItem(STORE_CHATS) || "[]");
    chats = Array.isArray(parsed) ? parsed.filter((c) => c && Array.isArray(c.messages)) : [];
  } catch (e) {
    chats = [];
    showError(`the saved conversations could not be read (${e.message}); starting afresh`);
  }
  currentId = localStorage.getItem(STORE_CURRENT);
  if (!chats.some((c) => c.id === currentId)) {
    currentId = chats.length ? chats[0].id : newChat().id;
  }
}

function saveChats() {
  try {
    localStorage.setItem(STORE_CHATS, JSON.stringify(chats));
    localStorage.setItem(STORE_CURRENT, currentId);
  } catch (e) {
    showError(`the conversation could not be saved in the browser's storage: ${e.message}`);
  }
}

function today() {
  return new Date().toISOString().slice(0, 10);
}

function newChat() {
  const chat = {
    id: `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`,
    date: today(),
    settings: readSettings(),
    messages: [],
  };
  chats.unshift(chat);
  currentId = chat.id;
  return chat;
}

function currentChat() {
  return chats.find((c) => c.id === currentId);
}

function chatTitle(chat) {
  const first = chat.messages.find((m) => m.role === "user");
  const text = first ? first.content.replace(/\s+/g, " ").trim() : "";
  return text ? (text.length > 40 ? `${text.slice(0, 40)}…` : text) : `New chat (${chat.date})`;
}

// ---------- settings ----------

function numberOr(id, fallback) {
  const v = $(id).valueAsNumber;
  return Number.isFinite(v) ? v : fallback;
}

function readSettings() {
  const maxTokens = $("max-tokens").valueAsNumber;
  return {
    effort: $("effort").value,
    temperature: numberOr("temperature", 1),
    top_p: numberOr("top-p", 1),
    max_tokens: Number.isInteger(maxTokens) && maxTokens > 0 ? maxTokens : null,
    system: $("system").value,
    tools: $("tools").value,
  };
}

function showSettings(s) {
  $("effort").value = s.effort || "medium";
  $("temperature").value = s.temperature ?? 1;
  $("top-p").value = s.top_p ?? 1;
  $("max-tokens").value = s.max_tokens ?? "";
  $("system").value = s.system || "";
  $("tools").value = s.tools || "";
}

// The tools of the settings, or throws with a message naming the problem.
function parseTools(text) {
  if (!text.trim()) return [];
  let tools;
  try {
    tools = JSON.parse(text);
  } catch (e) {
    throw new Error(`the tools setting is not JSON: ${e.message}`);
  }
  if (!Array.isArray(tools)) throw new Error("the tools setting must be a JSON list of tools");
  tools.forEach((t, i) => {
    if (!t || t.type !== "function" || !t.function || typeof t.function.name !== "string") {
      throw new Error(`tools[${i}] is not {"type": "function", "function": {"name": ...}}`);
    }
  });
  return tools;
}

// ---------- the API ----------

function authHeaders() {
  const key = localStorage.getItem(STORE_KEY);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// Asks for the API key (once per 401), keeps it, and resolves when one is given.
function askKey(message) {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    if (dialog.open) {
      // Already asking (for another request): that answer serves this one too.
      dialog.addEventListener("close", () => resolve(Boolean(localStorage.getItem(STORE_KEY))), { once: true });
      return;
    }
    dialog.querySelector("p").textContent = message || "This server needs an API key.";
    $("key").value = "";
    dialog.addEventListener(
      "close",
      () => {
        const key = $("key").value.trim();
        if (key) localStorage.setItem(STORE_KEY, key);
        resolve(Boolean(key));
      },
      { once: true },
    );
    dialog.showModal();
  });
}

async function errorText(response) {
  const text = await response.text();
  try {
    const e = JSON.parse(text).error;
    if (e && e.message) return `${response.status}: ${e.message}${e.param ? ` (${e.param})` : ""}`;
  } catch (_) {
    // not JSON: show it as it is
  }
  return `${response.status}: ${text || response.statusText}`;
}

// A GET that asks for the key on a 401; null when it fails.
async function getApi(path) {
  for (;;) {
    const response = await fetch(path, { headers: authHeaders() });
    if (response.status === 401) {
      if (!(await askKey(await keyMessage(response)))) return null;
      continue;
    }
    return response;
  }
}

async function keyMessage(response) {
  const had = Boolean(localStorage.getItem(STORE_KEY));
  const why = await errorText(response);
  return had ? `The key was refused (${why}). Enter the server's API key.` : "This server needs an API key.";
}

function apiMessages(chat) {
  const out = [];
  if (chat.settings.system.trim()) out.push({ role: "system", content: chat.settings.system });
  for (const m of chat.messages) {
    if (m.role === "user") out.push({ role: "user", content: m.content });
    else if (m.role === "tool") out.push({ role: "tool", tool_call_id: m.tool_call_id, content: m.content });
    else if (m.content || m.reasoning || m.tool_calls.length) {
      const a = { role: "assistant", content: m.tool_calls.length && !m.content ? null : m.content };
      if (m.reasoning) a.reasoning_content = m.reasoning;
      if (m.tool_calls.length) a.tool_calls = m.tool_calls;
      out.push(a);
    }
  }
  return out;
}

function requestBody(chat, tools) {
  const s = chat.settings;
  const body = {
    messages: apiMessages(chat),
    stream: true,
    stream_options: { include_usage: true },
    reasoning_effort: s.effort,
    temperature: s.temperature,
    top_p: s.top_p,
  };
  if (s.max_tokens) body.max_tokens = s.max_tokens;
  if (tools.length) body.tools = tools;
  return body;
}

// Calls `onEvent` with each JSON object of a server-sent event stream, until `[DONE]`.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue; // a keep-alive comment
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}

// Streams the assistant's answer to the conversation as it stands.
async function answer(chat) {
  let tools;
  try {
    tools = parseTools(chat.settings.tools);
  } catch (e) {
    showError(e.message);
    return false;
  }
  const reply = { role: "assistant", content: "", reasoning: "", tool_calls: [], finish: null, stats: null };
  const controller = new AbortController();
  running = { controller };
  setRunning(true);
  const started = performance.now();
  let firstToken = null;
  let usage = null;
  let view = null;
  try {
    let response;
    for (;;) {
      response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authHeaders() },
        body: JSON.stringify(requestBody(chat, tools)),
        signal: controller.signal,
      });
      if (response.status !== 401) break;
      if (!(await askKey(await keyMessage(response)))) {
        showError("no API key given");
        return false;
      }
    }
    if (!response.ok) {
      showError(await errorText(response));
      return false;
    }
    chat.messages.push(reply);
    view = renderMessage(reply, true);
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(`the server failed: ${chunk.error.message}`);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const d = choice.delta || {};
      const reasoning = d.reasoning_content ?? d.reasoning;
      if (reasoning) reply.reasoning += reasoning;
      if (d.content) reply.content += d.content;
      for (const call of d.tool_calls || []) {
        if (call.id) {
          reply.tool_calls[call.index] = {
            id: call.id,
            type: "function",
            function: { name: call.function.name, arguments: call.function.arguments || "" },
          };
        } else if (reply.tool_calls[call.index]) {
          reply.tool_calls[call.index].function.arguments += call.function.arguments || "";
        }
      }
      if (firstToken === null && (reasoning || d.content || d.tool_calls)) firstToken = performance.now();
      if (choice.finish_reason) reply.finish = choice.finish_reason;
      updateMessage(view, reply, true);
    });
  } catch (e) {
    if (e.name === "AbortError") reply.finish = "stopped";
    else showError(e.message);
  } finally {
    running = null;
    setRunning(false);
  }
  reply.stats = answerStats(usage, started, firstToken, performance.now());
  if (usage) lastUsage = usage;
  if (view) updateMessage(view, reply, false);
  saveChats();
  refreshStatus();
  return true;
}

// Token counts from the server's usage, speeds from the browser's clock (first token and end
// of the stream): prefill speed counts the queue wait and the request too.
function answerStats(usage, started, firstToken, ended) {
  if (!usage) return null;
  const prompt = usage.prompt_tokens;
  const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
  const generated = usage.completion_tokens;
  const stats = { prompt, cached, generated, prefill_tps: null, decode_tps: null };
  if (firstToken !== null) {
    const prefill = (firstToken - started) / 1000;
    const decode = (ended - firstToken) / 1000;
    if (prefill > 0 && prompt > cached) stats.prefill_tps = (prompt - cached) / prefill;
    if (decode > 0 && generated > 1) stats.decode_tps = (generated - 1) / decode;
  }
  return stats;
}

function statsText(s) {
  const speed = (v) => (v === null ? "–" : v >= 100 ? v.toFixed(0) : v.toFixed(1));
  return (
    `${s.prompt} prompt tokens (${s.cached} cached) · ${s.generated} generated · ` +
    `prefill ${speed(s.prefill_tps)} tok/s · decode ${speed(s.decode_tps)} tok/s`
  );
}

// ---------- the page ----------

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

function showError(message) {
  const e = $("error");
  e.textContent = message;
  e.hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function setRunning(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  for (const id of ["chats", "new-chat", "delete-chat"]) $(id).disabled = on;
}

function renderChats() {
  const select = $("chats");
  select.replaceChildren(
    ...chats.map((c) => {
      const o = el("option", null, chatTitle(c));
      o.value = c.id;
      o.selected = c.id === currentId;
      return o;
    }),
  );
}

function renderLog() {
  const chat = currentChat();
  $("log").replaceChildren();
  chat.messages.forEach((m) => renderMessage(m, false));
  renderChats();
}

function renderMessage(m, streaming) {
  const root = el("div", `msg ${m.role}`);
  if (m.role === "user") {
    root.append(el("div", "text", m.content));
    $("log").append(root);
    return null;
  }
  if (m.role === "tool") {
    root.append(el("div", "tool-result", `${m.name} returned: ${m.content}`));
    $("log").append(root);
    return null;
  }
  const reasoning = el("details", "reasoning");
  reasoning.append(el("summary", null, "Reasoning"), el("div", "text"));
  reasoning.open = streaming;
  const view = { root, reasoning, calls: el("div"), content: el("div", "text answer"), note: el("div", "note"), stats: el("div", "stats") };
  root.append(reasoning, view.content, view.calls, view.note, view.stats);
  $("log").append(root);
  updateMessage(view, m, streaming);
  return view;
}

const FINISH_NOTES = {
  stopped: "(stopped)",
  length: "(cut at the token limit or the end of the context)",
};

function updateMessage(view, m, streaming) {
  view.reasoning.hidden = !m.reasoning;
  view.reasoning.querySelector(".text").textContent = m.reasoning;
  view.content.textContent = m.content;
  view.calls.replaceChildren(...m.tool_calls.filter(Boolean).map((c) => callBlock(m, c, streaming)));
  view.note.textContent = FINISH_NOTES[m.finish] || "";
  view.stats.textContent = m.stats ? statsText(m.stats) : "";
  if (streaming) view.root.scrollIntoView({ block: "end" });
}

// A tool call, with a box for its result while it is the conversation's last message.
function callBlock(m, call, streaming) {
  const block = el("div", "call");
  block.append(el("strong", null, `Tool call: ${call.function.name}`), " ", el("code", null, call.function.arguments));
  const chat = currentChat();
  const last = chat.messages[chat.messages.length - 1] === m;
  if (!streaming && last && m.finish === "tool_calls") {
    const form = el("form");
    const input = el("input");
    input.placeholder = `What ${call.function.name} returned`;
    input.setAttribute("aria-label", `Result of ${call.function.name}`);
    form.append(input, el("button", null, "Send result"));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      if (running) return;
      clearError();
      chat.messages.push({ role: "tool", tool_call_id: call.id, name: call.function.name, content: input.value });
      saveChats();
      renderLog();
      await answer(chat);
    });
    block.append(form);
  }
  return block;
}

async function send() {
  const text = $("input").value;
  if (!text.trim() || running) return;
  clearError();
  const chat = currentChat();
  chat.settings = readSettings();
  chat.messages.push({ role: "user", content: text });
  $("input").value = "";
  saveChats();
  renderLog();
  if (!(await answer(chat))) {
    // Refused before it started (a bad request, a full context): take the message back.
    chat.messages.pop();
    $("input").value = text;
    saveChats();
    renderLog();
  }
}

function stop() {
  if (running) running.controller.abort();
}

// ---------- status line ----------

async function refreshStatus() {
  const status = $("status");
  try {
    if (!model) {
      const response = await getApi("/v1/models");
      if (!response) return;
      if (response.status === 503) {
        status.textContent = "the model is loading…";
        setTimeout(refreshStatus, 1000);
        return;
      }
      if (!response.ok) throw new Error(await errorText(response));
      model = (await response.json()).data[0];
    }
    const parts = [`model ${model.id}`];
    if (lastUsage) {
      const used = lastUsage.prompt_tokens + lastUsage.completion_tokens;
      parts.push(`context ${used} / ${model.context_length} tokens`);
    } else {
      parts.push(`context ${model.context_length} tokens`);
    }
    const hits = await expertHitRate();
    if (hits !== null) parts.push(`expert cache ${(100 * hits).toFixed(1)}% hits`);
    status.textContent = parts.join(" · ");
  } catch (e) {
    status.textContent = `status unavailable: ${e.message}`;
  }
}

// The expert cache's hit rate from /metrics, or null when it has no expert requests.
async function expertHitRate() {
  const response = await getApi("/metrics");
  if (!response || !response.ok) return null;
  const text = await response.text();
  const count = (result) => {
    const m = text.match(new RegExp(`^picchio_expert_requests_total\\{result="${result}"\\} (\\S+)$`, "m"));
    return m ? Number(m[1]) : 0;
  };
  const hit = count("hit");
  const total = hit + count("miss");
  return total > 0 ? hit / total : null;
}

// ---------- export ----------

// The conversation as `picchio chat` /save writes it (format picchio-chat/1): its settings
// and the Harmony messages, so that `/load FILE` in the terminal chat continues it.
function exportChat(chat) {
  const s = chat.settings;
  const effort = s.effort.charAt(0).toUpperCase() + s.effort.slice(1);
  const text = (t) => [{ type: "text", text: t }];
  const messages = [
    {
      role: "system",
      name: null,
      content: [
        {
          type: "system_content",
          model_identity: MODEL_IDENTITY,
          reasoning_effort: effort,
          conversation_start_date: chat.date,
          knowledge_cutoff: KNOWLEDGE_CUTOFF,
          channel_config: { valid_channels: ["analysis", "commentary", "final"], channel_required: true },
        },
      ],
    },
  ];
  let tools = [];
  try {
    tools = parseTools(s.tools);
  } catch (_) {
    // an invalid tools setting was never sent: nothing to export
  }
  if (s.system.trim() || tools.length) {
    const developer = { type: "developer_content" };
    if (s.system.trim()) developer.instructions = s.system;
    if (tools.length) {
      developer.tools = {
        functions: {
          name: "functions",
          tools: tools.map((t) => {
            const d = { name: t.function.name, description: t.function.description || "" };
            if (t.function.parameters) d.parameters = t.function.parameters;
            return d;
          }),
        },
      };
    }
    messages.push({ role: "developer", name: null, content: [developer] });
  }
  for (const m of chat.messages) {
    if (m.role === "user") messages.push({ role: "user", name: null, content: text(m.content) });
    else if (m.role === "tool") {
      messages.push({
        role: "tool",
        name: `functions.${m.name}`,
        recipient: "assistant",
        channel: "commentary",
        content: text(m.content),
      });
    } else {
      const calls = m.tool_calls.filter(Boolean);
      if (m.reasoning) messages.push({ role: "assistant", name: null, channel: "analysis", content: text(m.reasoning) });
      if (m.content) {
        const channel = calls.length ? "commentary" : "final";
        messages.push({ role: "assistant", name: null, channel, content: text(m.content) });
      }
      for (const c of calls) {
        messages.push({
          role: "assistant",
          name: null,
          recipient: `functions.${c.function.name}`,
          channel: "commentary",
          content_type: "<|constrain|>json",
          content: text(c.function.arguments),
        });
      }
    }
  }
  return {
    format: "picchio-chat/1",
    settings: {
      reasoning: s.effort,
      system: s.system.trim() ? s.system : null,
      temperature: s.temperature,
      top_p: s.top_p,
      top_k: 0,
      min_p: 0,
      repeat_penalty: 1,
      seed: null,
      max_tokens: s.max_tokens,
      stop: [],
      presence_penalty: 0,
      frequency_penalty: 0,
      logit_bias: [],
    },
    conversation: { messages },
  };
}

function download() {
  const chat = currentChat();
  const blob = new Blob([JSON.stringify(exportChat(chat), null, 2)], { type: "application/json" });
  const a = el("a");
  a.href = URL.createObjectURL(blob);
  a.download = `picchio-chat-${chat.date}.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

// ---------- wiring ----------

function start() {
  loadChats();
  showSettings(currentChat().settings);
  renderLog();
  $("compose").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && running) {
      e.preventDefault();
      stop();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    clearError();
    const chat = newChat();
    chat.settings = readSettings();
    saveChats();
    renderLog();
    $("input").focus();
  });
  $("delete-chat").addEventListener("click", () => {
    chats = chats.filter((c) => c.id !== currentId);
    currentId = chats.length ? chats[0].id : newChat().id;
    showSettings(currentChat().settings);
    saveChats();
    renderLog();
  });
  $("chats").addEventListener("change", (e) => {
    currentId = e.target.value;
    showSettings(currentChat().settings);
    saveChats();
    renderLog();
  });
  $("settings").addEventListener("change", () => {
    currentChat().settings = readSettings();
    saveChats();
  });
  $("export-chat").addEventListener("click", download);
  refreshStatus();
  $("input").focus();
}

// For tests and the curious: the current conversation in the `chat /save` format.
window.picchio = { exportChat: () => exportChat(currentChat()) };

start();
