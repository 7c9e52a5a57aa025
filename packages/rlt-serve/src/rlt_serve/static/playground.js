// rlt playground: a chat over the public API (POST v1/chat/completions with stream: true),
// colouring each streamed token by its exit depth (the per-choice `exit_depths` of each
// chunk). No dependencies, no build step. docs/serving.md ("The playground page") describes it.
//
// Mapping depths to text: a chunk carries `exit_depths` (one per token) and the new text.
// The page also asks for `logprobs`, whose entries give each token's own text: when those
// pieces add up to the chunk's text, every token gets its own element. Otherwise (text held
// back for an incomplete UTF-8 character or a possible stop string, or released later) the
// chunk's text is one element whose data-depth is the rounded mean of the depths it covers
// (all listed in data-depths). Depths of tokens without text yet are carried to the next
// text; those still left at the end (an end-of-turn token) become an empty `.tok-end` element.

"use strict";

(() => {
  const KEY_STORAGE = "rlt-playground-api-key";
  const DEFAULT_DEPTH = 4; // the default max_loops of Ouro models, when /v1/models is silent

  const $ = (id) => document.getElementById(id);
  const el = {
    transcript: $("transcript"),
    emptyHint: $("empty-hint"),
    error: $("error"),
    composer: $("composer"),
    prompt: document.querySelector("textarea"),
    send: $("send"),
    stop: $("stop"),
    clear: $("clear"),
    apiKey: $("api-key"),
    modelName: $("model-name"),
    modelDepth: $("model-depth"),
    threshold: $("exit-threshold"),
    thresholdRange: $("exit-threshold-range"),
    minLoops: $("min-loops"),
    maxLoops: $("max-loops"),
    temperature: $("temperature"),
    maxTokens: $("max-tokens"),
    statTokens: $("stat-tokens"),
    statRate: $("stat-tokens-per-s"),
    statMean: $("stat-mean-loops"),
    statTtft: $("stat-ttft"),
    histogram: $("depth-histogram"),
    legend: $("depth-legend"),
  };

  const state = {
    depth: DEFAULT_DEPTH, // T: loops of the served model
    model: null, // served model id, once known
    history: [], // [{role, content}] sent with every request
    controller: null, // AbortController of the request in flight
  };

  // ---------------------------------------------------------------- API key (sessionStorage)

  function apiKey() {
    return el.apiKey.value.trim();
  }

  function authHeaders() {
    const key = apiKey();
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  el.apiKey.value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    el.apiKey.dispatchEvent(new Event("change"));
  });
  el.apiKey.addEventListener("change", () => {
    const key = apiKey();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    hideError();
    loadModel();
  });

  // ---------------------------------------------------------------- errors

  function showError(message, { notice = false } = {}) {
    el.error.textContent = message;
    el.error.classList.toggle("notice", notice);
    el.error.hidden = false;
  }

  function hideError() {
    el.error.hidden = true;
    el.error.textContent = "";
    delete el.error.dataset.status;
  }

  // A readable message for an OpenAI-style error body {"error": {message, type, param, code}}.
  function describeError(status, body) {
    const error = body && typeof body === "object" ? body.error : null;
    const message = error && error.message ? error.message : String(body || "").trim();
    const parts = [];
    if (status) parts.push(`HTTP ${status}`);
    if (error && error.type) parts.push(error.type);
    if (error && error.param) parts.push(`field ${error.param}`);
    let text = `${parts.join(" · ")}${parts.length ? ": " : ""}${message || "(no message)"}`;
    if (status === 401) {
      text = apiKey()
        ? `The server refused the API key (HTTP 401). Check the "API key" field.\n${text}`
        : `This server needs an API key (HTTP 401): enter it in the "API key" field ` +
          `(kept in this browser tab only).\n${text}`;
    } else if (status === 403 && error && error.code === "forbidden_origin") {
      text +=
        "\nThis server refuses browser requests from its own pages: it is bound to a " +
        "non-loopback address without --api-key. Start it with --api-key, or with " +
        `--allowed-origin ${window.location.origin}.`;
    }
    return text;
  }

  async function errorFromResponse(response) {
    const raw = await response.text().catch(() => "");
    let body = raw;
    try {
      body = JSON.parse(raw);
    } catch (_) {
      // not JSON: show the text as it is
    }
    return describeError(response.status, body);
  }

  // ---------------------------------------------------------------- depth colours and legend

  function depthColour(depth, total) {
    // A ramp from blue (few loops) over green and yellow to red (full depth).
    const hue = total > 1 ? 200 - (200 * (depth - 1)) / (total - 1) : 0;
    return `hsl(${Math.round(hue)} 70% 78%)`;
  }

  function defineDepthColours() {
    const root = document.documentElement;
    const styles = getComputedStyle(root);
    for (let d = 1; d <= state.depth; d++) {
      const name = `--depth-${d}`;
      if (!styles.getPropertyValue(name).trim() || root.style.getPropertyValue(name)) {
        root.style.setProperty(name, depthColour(d, state.depth));
      }
    }
  }

  function paint(element, depth) {
    element.style.backgroundColor = `var(--depth-${depth})`;
  }

  function buildLegend() {
    el.legend.replaceChildren();
    for (let d = 1; d <= state.depth; d++) {
      const item = document.createElement("li");
      item.dataset.bin = String(d);
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      paint(swatch, d);
      item.append(swatch, document.createTextNode(`${d}`));
      el.legend.append(item);
    }
    const unit = document.createElement("li");
    unit.className = "unit";
    unit.textContent = `loop${state.depth === 1 ? "" : "s"} (of ${state.depth})`;
    el.legend.append(unit);
  }

  // ---------------------------------------------------------------- histogram and stats

  let stats = newStats();

  function newStats() {
    return {
      tokens: 0, // every generated token, token 0 included
      counts: new Array(state.depth + 1).fill(0), // decoded tokens (token 0 excluded) by depth
      loops: 0, // loops of the decoded tokens
      start: performance.now(),
      first: null, // time of the chunk that brought token 0
      last: null, // time of the chunk that brought the latest token
    };
  }

  function buildHistogram() {
    el.histogram.replaceChildren();
    for (let d = 1; d <= state.depth; d++) {
      const bin = document.createElement("div");
      bin.className = "bin";
      bin.dataset.bin = String(d);
      bin.dataset.count = "0";
      const count = document.createElement("span");
      count.className = "count";
      const bar = document.createElement("div");
      bar.className = "bar";
      paint(bar, d);
      bin.append(count, bar);
      el.histogram.append(bin);
    }
    let axis = el.histogram.nextElementSibling;
    if (!axis || !axis.classList.contains("axis")) {
      axis = document.createElement("div");
      axis.className = "axis";
      el.histogram.after(axis);
    }
    axis.replaceChildren();
    for (let d = 1; d <= state.depth; d++) {
      const label = document.createElement("span");
      label.textContent = String(d);
      axis.append(label);
    }
    renderStats();
  }

  function recordDepths(depths, now) {
    for (const depth of depths) {
      if (stats.tokens === 0) {
        stats.first = now;
      } else {
        if (depth >= 1 && depth < stats.counts.length) stats.counts[depth] += 1;
        stats.loops += depth;
      }
      stats.tokens += 1;
      stats.last = now;
    }
  }

  function format(value, digits) {
    return Number.isFinite(value) ? value.toFixed(digits) : "–";
  }

  function renderStats() {
    const decoded = stats.tokens - 1;
    const mean = decoded > 0 ? stats.loops / decoded : NaN;
    // Decode speed: tokens after the first over the time since the first arrived.
    const span = stats.first !== null ? (stats.last - stats.first) / 1000 : 0;
    const rate = decoded > 0 && span > 0 ? decoded / span : NaN;
    const ttft = stats.first !== null ? stats.first - stats.start : NaN;
    el.statTokens.textContent = String(stats.tokens);
    el.statTokens.dataset.value = String(stats.tokens);
    el.statRate.textContent = format(rate, 1);
    el.statRate.dataset.value = Number.isFinite(rate) ? String(rate) : "";
    el.statMean.textContent = format(mean, 2);
    el.statMean.dataset.value = Number.isFinite(mean) ? String(mean) : "";
    el.statTtft.textContent = Number.isFinite(ttft) ? `${Math.round(ttft)} ms` : "–";
    const highest = Math.max(1, ...stats.counts);
    for (const bin of el.histogram.children) {
      const d = Number(bin.dataset.bin);
      const count = stats.counts[d] || 0;
      bin.dataset.count = String(count);
      bin.title = `${count} token${count === 1 ? "" : "s"} exited after ${d} loop${d === 1 ? "" : "s"}`;
      bin.querySelector(".count").textContent = count ? String(count) : "";
      bin.querySelector(".bar").style.height = `${(100 * count) / highest}%`;
    }
    return { decoded, mean, rate };
  }

  // ---------------------------------------------------------------- model depth (GET /v1/models)

  // depth: the most loops a request may ask (the engine's cap); defaultLoops: what a request
  // that omits max_loops runs (the checkpoint's count), the field's value until touched
  function applyDepth(depth, defaultLoops = depth) {
    state.depth = depth;
    for (const input of [el.minLoops, el.maxLoops]) input.max = String(depth);
    if (Number(el.maxLoops.value) > depth || el.maxLoops.dataset.touched !== "1") {
      el.maxLoops.value = String(Math.min(defaultLoops, depth));
    }
    if (Number(el.minLoops.value) > depth) el.minLoops.value = String(depth);
    el.modelDepth.textContent = `T = ${depth} loops`;
    defineDepthColours();
    buildLegend();
    stats = newStats();
    buildHistogram();
  }

  async function loadModel() {
    try {
      const response = await fetch("v1/models", { headers: authHeaders(), cache: "no-store" });
      if (!response.ok) {
        el.modelName.textContent = "(model unknown)";
        showError(await errorFromResponse(response));
        return;
      }
      const card = ((await response.json()).data || [])[0] || {};
      state.model = card.id || null;
      el.modelName.textContent = card.id || "(model unknown)";
      if (Number.isInteger(card.num_loops) && card.num_loops >= 1) {
        const fallback = card.num_loops;
        const given = card.default_loops;
        applyDepth(card.num_loops, Number.isInteger(given) && given >= 1 ? given : fallback);
      }
    } catch (error) {
      showError(`Cannot reach the server: ${error.message}`);
    }
  }

  // ---------------------------------------------------------------- controls

  el.threshold.addEventListener("input", () => {
    el.thresholdRange.value = el.threshold.value;
  });
  el.thresholdRange.addEventListener("input", () => {
    el.threshold.value = el.thresholdRange.value;
  });
  el.maxLoops.addEventListener("input", () => {
    el.maxLoops.dataset.touched = "1";
  });

  function number(input, name, integer) {
    const value = Number(input.value);
    if (input.value.trim() === "" || !Number.isFinite(value) || (integer && !Number.isInteger(value))) {
      throw new Error(`${name}: "${input.value}" is not ${integer ? "an integer" : "a number"}`);
    }
    return value;
  }

  function requestBody() {
    const body = {
      messages: state.history,
      stream: true,
      stream_options: { include_usage: true },
      logprobs: true, // per-token text, to give each token its own element
      temperature: number(el.temperature, "temperature", false),
      max_tokens: number(el.maxTokens, "max tokens", true),
      exit_threshold: number(el.threshold, "exit threshold", false),
      min_loops: number(el.minLoops, "min loops", true),
      max_loops: number(el.maxLoops, "max loops", true),
    };
    if (state.model) body.model = state.model;
    return body;
  }

  // ---------------------------------------------------------------- transcript

  function addMessage(role, text) {
    if (el.emptyHint) el.emptyHint.remove();
    const message = document.createElement("div");
    message.className = `msg ${role}`;
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = role === "user" ? "you" : state.model || "assistant";
    const content = document.createElement("div");
    content.className = "content";
    if (text) content.textContent = text;
    const meta = document.createElement("div");
    meta.className = "meta";
    message.append(who, content, meta);
    el.transcript.append(message);
    scrollDown();
    return { message, content, meta };
  }

  function scrollDown() {
    el.transcript.scrollTop = el.transcript.scrollHeight;
  }

  // Adds one chunk's text and depths to a reply being streamed (see the top of this file).
  function addChunk(reply, choice) {
    const depths = Array.isArray(choice.exit_depths) ? choice.exit_depths : [];
    const text = (choice.delta && choice.delta.content) || "";
    const pieces =
      choice.logprobs && Array.isArray(choice.logprobs.content)
        ? choice.logprobs.content.map((entry) => entry.token)
        : [];
    reply.pendingDepths.push(...depths);
    reply.pendingPieces.push(...(pieces.length === depths.length ? pieces : depths.map(() => null)));
    reply.text += text;
    if (!text) return;
    const pending = reply.pendingDepths;
    const exact =
      pending.length > 1 &&
      reply.pendingPieces.every((piece) => typeof piece === "string") &&
      reply.pendingPieces.join("") === text;
    if (pending.length === 0) {
      // Text released without new tokens: it belongs to the latest token element.
      const last = reply.content.lastElementChild;
      if (last) last.append(text);
      else reply.content.append(text);
    } else if (pending.length === 1 || exact) {
      pending.forEach((depth, i) =>
        reply.content.append(tokenElement(pending.length === 1 ? text : reply.pendingPieces[i], [depth], reply)),
      );
    } else {
      reply.content.append(tokenElement(text, pending, reply));
    }
    reply.pendingDepths = [];
    reply.pendingPieces = [];
  }

  function tokenElement(text, depths, reply) {
    const span = document.createElement("span");
    const depth = Math.round(depths.reduce((a, b) => a + b, 0) / depths.length);
    span.className = "tok";
    span.dataset.depth = String(depth);
    if (depths.length > 1) span.dataset.depths = depths.join(" ");
    if (reply.index === 0) span.classList.add("prefill");
    const what =
      depths.length > 1
        ? `${depths.length} tokens, loops ${depths.join(", ")} (mean ${depth})`
        : `${depth} loop${depth === 1 ? "" : "s"}`;
    span.title = reply.index === 0 ? `${what}; token 0 comes from prefill at full depth` : what;
    reply.index += depths.length;
    paint(span, depth);
    span.textContent = text;
    return span;
  }

  function finishTokens(reply) {
    if (reply.pendingDepths.length) {
      const span = tokenElement("", reply.pendingDepths, reply);
      span.classList.add("tok-end");
      span.title += " (no text: end of the turn)";
      reply.content.append(span);
      reply.pendingDepths = [];
      reply.pendingPieces = [];
    }
  }

  // ---------------------------------------------------------------- streaming

  async function* sseData(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
      const lines = buffer.split("\n");
      buffer = done ? "" : lines.pop();
      for (const raw of lines) {
        const line = raw.replace(/\r$/, "");
        if (line.startsWith("data:")) yield line.slice(5).trimStart();
      }
      if (done) return;
    }
  }

  function setStreaming(streaming) {
    document.body.dataset.state = streaming ? "streaming" : "ready";
    el.send.disabled = streaming;
    el.stop.disabled = !streaming;
    el.clear.disabled = streaming;
  }

  async function send() {
    if (state.controller) return;
    const prompt = el.prompt.value;
    if (!prompt.trim()) {
      el.prompt.focus();
      return;
    }
    hideError();
    state.history.push({ role: "user", content: prompt });
    let body;
    try {
      body = requestBody();
    } catch (error) {
      state.history.pop();
      showError(error.message);
      return;
    }
    const userMessage = addMessage("user", prompt);
    el.prompt.value = "";
    const reply = addMessage("assistant", "");
    Object.assign(reply, { text: "", index: 0, pendingDepths: [], pendingPieces: [] });
    stats = newStats();
    renderStats();
    const controller = new AbortController();
    state.controller = controller;
    setStreaming(true);
    let failure = null;
    let finish = null;
    let stopped = false;
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...authHeaders() },
        body: JSON.stringify(body),
        signal: controller.signal,
        cache: "no-store",
      });
      if (!response.ok) {
        failure = await errorFromResponse(response);
        el.error.dataset.status = String(response.status);
      } else {
        for await (const data of sseData(response)) {
          if (data === "[DONE]") break;
          let chunk;
          try {
            chunk = JSON.parse(data);
          } catch (_) {
            failure = `The server sent an unreadable event: ${data.slice(0, 200)}`;
            break;
          }
          if (chunk.error) {
            failure = describeError(null, chunk);
            continue; // [DONE] follows
          }
          const now = performance.now();
          for (const choice of chunk.choices || []) {
            recordDepths(choice.exit_depths || [], now);
            addChunk(reply, choice);
            if (choice.finish_reason) finish = choice.finish_reason;
          }
          renderStats();
          scrollDown();
        }
      }
    } catch (error) {
      if (error.name === "AbortError") stopped = true;
      else failure = `The request failed: ${error.message}`;
    } finally {
      state.controller = null;
    }
    finishTokens(reply);
    const { decoded, mean, rate } = renderStats();
    if (reply.text || stats.tokens) {
      state.history.push({ role: "assistant", content: reply.text });
      const parts = [`${stats.tokens} token${stats.tokens === 1 ? "" : "s"}`];
      if (decoded > 0) parts.push(`${format(mean, 2)} loops/token`);
      if (Number.isFinite(rate)) parts.push(`${format(rate, 1)} tokens/s`);
      parts.push(stopped ? "stopped" : `finish: ${finish || "?"}`);
      reply.meta.textContent = parts.join(" · ");
    } else {
      // Nothing came back: forget the turn, so that sending again does not repeat it.
      state.history.pop();
      reply.message.remove();
      userMessage.message.classList.add("failed");
      if (!failure && !stopped) failure = "The server ended the stream without any token.";
    }
    if (failure) showError(failure);
    else if (stopped) showError("Stopped.", { notice: true });
    setStreaming(false);
    el.prompt.focus();
  }

  el.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  el.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  el.stop.addEventListener("click", () => {
    if (state.controller) state.controller.abort();
  });
  el.clear.addEventListener("click", () => {
    state.history = [];
    el.transcript.replaceChildren();
    hideError();
    stats = newStats();
    renderStats();
    el.prompt.focus();
  });

  // ---------------------------------------------------------------- start

  applyDepth(DEFAULT_DEPTH);
  setStreaming(false);
  document.body.dataset.state = "loading";
  loadModel().finally(() => {
    if (!state.controller) setStreaming(false);
    el.prompt.focus();
  });
})();
