// grpo-cluster report: the sample browser (cluster/sinks/report/page.py embeds this file).
//
// Reads the run's samples from <script id="samples-data"> ({"train": {step: [group records]}, "eval": {step:
// [problem records]}}, cluster/loop/samples.py) and shows step -> group (or problem) -> completion. What is open is
// the URL fragment: #train/<step>/<group id>/<completion index>[/<shading>], #eval/<step>/<problem>/<completion index>,
// or a prefix of one (<shading>: advantage, gap or trained). Every text from the data goes into the page with
// textContent, never as markup.
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("samples-data").textContent);
  const MODES = {
    advantage: "advantage: green > 0, red < 0, full colour at the group's largest |advantage|; trained tokens only",
    gap: "trainer − engine logprob: orange > 0, purple < 0, full colour at the group's largest |gap|",
    trained: "trained on (blue: in the loss; grey: not)",
  };
  let mode = "advantage";
  let gapScale = 1;  // nats: the largest |trainer − engine| of the open group's tokens (set by renderSample)

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function fmt(value, digits) {
    if (value === null || value === undefined) return "–";
    if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toFixed(digits || 3);
    return String(value);
  }
  function steps(kind) {
    return Object.keys(DATA[kind] || {}).map(Number).sort((a, b) => a - b);
  }
  function parseHash() {
    const parts = decodeURIComponent(location.hash.replace(/^#/, "")).split("/");
    if (parts[0] !== "train" && parts[0] !== "eval") return null;
    const nums = parts.slice(1, 4).map((p) => (p === "" ? NaN : Number(p)));
    return { kind: parts[0], step: nums[0], group: nums[1], index: nums[2], mode: MODES[parts[4]] ? parts[4] : null };
  }
  function groupsOf(kind, step) {
    return (DATA[kind] || {})[String(step)] || [];
  }
  function groupKey(kind, record) {
    return kind === "train" ? record.group_id : record.problem;
  }
  function link(list, href, text, selected) {
    const item = el("li");
    const a = el("a", { href: href }, text);
    if (selected) a.className = "selected";
    item.appendChild(a);
    list.appendChild(item);
  }
  function mean(values) {
    const xs = values.filter((v) => typeof v === "number");
    return xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null;
  }

  function renderLists(state) {
    const stepList = document.getElementById("steps");
    const groupList = document.getElementById("groups");
    const compList = document.getElementById("completions");
    for (const list of [stepList, groupList, compList]) list.replaceChildren();
    for (const step of steps("train")) {
      const n = groupsOf("train", step).length;
      link(stepList, "#train/" + step, "step " + step + " · " + n + " group" + (n === 1 ? "" : "s"),
        state && state.kind === "train" && state.step === step);
    }
    for (const step of steps("eval")) {
      const problems = groupsOf("eval", step);
      const acc = mean(problems.map((p) => p.accuracy));
      link(stepList, "#eval/" + step, "eval after step " + step + " · " + problems.length + " problems · acc " +
        fmt(acc === null ? null : acc * 100, 1) + " %", state && state.kind === "eval" && state.step === step);
    }
    if (!stepList.children.length) stepList.appendChild(el("li", {}, "no samples in this run"));
    if (!state || Number.isNaN(state.step)) return;
    document.getElementById("groups-title").textContent = state.kind === "eval" ? "Problem" : "Group";
    for (const record of groupsOf(state.kind, state.step)) {
      const key = groupKey(state.kind, record);
      const rewards = record.completions.map((c) => (state.kind === "eval" ? c.correct : c.reward));
      const label = state.kind === "eval"
        ? "problem " + key + " · correct " + fmt(record.accuracy, 2) + " · ref " + fmt(record.reference)
        : "group " + key + (record.mixed ? " · mixed" : " · flat") + " · mean reward " + fmt(mean(rewards));
      link(groupList, "#" + state.kind + "/" + state.step + "/" + key, label, state.group === key);
    }
    const record = groupsOf(state.kind, state.step).find((r) => groupKey(state.kind, r) === state.group);
    if (!record) return;
    for (const c of record.completions) {
      const label = state.kind === "eval"
        ? "#" + c.index + " · " + (c.correct ? "correct" : "wrong") + " · " + c.finish_reason + " · " + c.length + " tok"
        : "#" + c.index + " · reward " + fmt(c.reward) + " · adv " + fmt(c.advantage) + " · " + c.finish_reason +
          " · " + c.length + " tok" + (c.excluded ? " · excluded" : "");
      link(compList, "#" + state.kind + "/" + state.step + "/" + state.group + "/" + c.index, label,
        state.index === c.index);
    }
  }

  function shading(c, i, scale) {
    const trained = typeof c.trained === "string" && c.trained[i] === "1";
    if (mode === "trained") return trained ? "rgba(31,119,180,0.28)" : "rgba(128,128,128,0.22)";
    if (mode === "advantage") {
      if (!trained || typeof c.advantage !== "number" || c.advantage === 0) return "";
      const alpha = (Math.min(Math.abs(c.advantage) / scale, 1) * 0.6).toFixed(3);
      return c.advantage > 0 ? "rgba(44,160,44," + alpha + ")" : "rgba(214,39,40," + alpha + ")";
    }
    const gap = Array.isArray(c.gap) ? c.gap[i] : null;
    if (typeof gap !== "number") return "";
    const alpha = (Math.min(Math.abs(gap) / gapScale, 1) * 0.75).toFixed(3);
    return gap >= 0 ? "rgba(255,127,14," + alpha + ")" : "rgba(148,103,189," + alpha + ")";
  }
  function tokenSpans(container, c, start, end, scale) {
    const tokens = c.tokens;
    for (let i = start; i < end; i++) {
      const trained = typeof c.trained === "string" && c.trained[i] === "1";
      const span = el("span", { class: "tok" + (trained ? "" : " untrained"), "data-i": String(i) }, tokens[i]);
      const gap = Array.isArray(c.gap) ? c.gap[i] : null;
      const logprob = Array.isArray(c.logprob) ? c.logprob[i] : null;
      span.title = JSON.stringify(tokens[i]) + " · engine logprob " + fmt(logprob, 4) + " · trainer − engine " +
        fmt(gap, 4) + " · " + (trained ? "trained on" : "not trained on");
      const colour = shading(c, i, scale);
      if (colour) span.style.backgroundColor = colour;
      container.appendChild(span);
    }
  }
  function toolCalls(block, turn) {
    for (const call of turn.tool_calls || []) {
      const text = call.error ? "unreadable tool call: " + call.error : "tool call: " + call.name + " " +
        JSON.stringify(call.arguments);
      block.appendChild(el("div", { class: "toolcall" }, text));
    }
  }
  function fieldsTable(view, rows) {
    const table = el("table", { class: "fields" });
    for (const [name, value] of rows) {
      if (value === undefined) continue;
      const tr = el("tr");
      tr.appendChild(el("td", {}, name));
      tr.appendChild(el("td", {}, typeof value === "object" && value !== null ? JSON.stringify(value) : fmt(value)));
      table.appendChild(tr);
    }
    view.appendChild(table);
  }
  function modeChooser(view, state) {
    const box = el("div", { class: "modes" }, "Shade tokens by: ");
    for (const [name, text] of Object.entries(MODES)) {
      const label = el("label");
      const input = el("input", { type: "radio", name: "shade", value: name });
      input.checked = name === mode;
      input.addEventListener("change", () => {
        location.hash = [state.kind, state.step, state.group, state.index, name].join("/");
      });
      label.appendChild(input);
      label.appendChild(document.createTextNode(" " + name));
      box.appendChild(label);
    }
    view.appendChild(box);
    const scale = mode === "gap" ? ", " + gapScale.toPrecision(3) + " nats" : "";
    view.appendChild(el("div", { class: "legend" }, MODES[mode] + scale + ". Grey text: tokens not trained on " +
      "(past the EOS, an observation, or a completion left out of the loss). Hover a token for its numbers."));
  }

  function renderSample(state) {
    const view = document.getElementById("sample-view");
    view.replaceChildren();
    const record = state && groupsOf(state.kind, state.step).find((r) => groupKey(state.kind, r) === state.group);
    const c = record && record.completions.find((x) => x.index === state.index);
    if (!c) {
      view.appendChild(el("p", { class: "meta" }, "No completion open."));
      view.removeAttribute("data-open");
      return;
    }
    view.setAttribute("data-open", state.kind + "/" + state.step + "/" + state.group + "/" + state.index);
    view.appendChild(el("h3", {}, (state.kind === "eval" ? "Held-out problem " : "Group ") + state.group +
      ", completion " + c.index + (state.kind === "eval" ? " (evaluation after step " : " (step ") + state.step + ")"));
    const prompt = el("details");
    prompt.appendChild(el("summary", {}, "prompt (" + record.prompt_tokens + " tokens" +
      (record.prompt_cut ? ", its start cut" : "") + ") · reference " + fmt(record.reference)));
    prompt.appendChild(el("pre", {}, c.prompt !== undefined ? c.prompt : record.prompt));
    view.appendChild(prompt);
    const episode = c.episode || {};
    fieldsTable(view, state.kind === "eval" ? [
      ["correct", c.correct], ["format", c.format], ["finish reason", c.finish_reason], ["length", c.length],
      ["policy version", c.version], ["turns", episode.turns], ["tool calls", episode.tool_calls],
    ] : [
      ["reward", c.reward], ["components", c.rewards], ["advantage", c.advantage],
      ["finish reason", c.finish_reason + (c.terminated ? " (EOS)" : " (no EOS)")],
      ["length", c.length + " tokens (" + c.sampled_tokens + " sampled, " + c.loss_tokens + " in the loss)"],
      ["policy version", c.version + " (staleness " + c.staleness + "; trained into version " +
        record.policy_version + ")"],
      ["left out", c.excluded || undefined], ["episode", c.episode || undefined],
    ]);
    if (c.cut) view.appendChild(el("p", { class: "note" }, "Cut to the first tokens (metrics.sample_max_tokens): " +
      "the completion has " + c.length + "."));
    if (!Array.isArray(c.tokens)) {
      for (const turn of c.turns || []) {
        const block = el("div", { class: "turn " + turn.role });
        block.appendChild(el("div", { class: "role" }, turn.role));
        block.appendChild(el("div", { class: "tokens" }, turn.text));
        toolCalls(block, turn);
        view.appendChild(block);
      }
      if (!c.turns) view.appendChild(el("pre", { class: "tokens", id: "sample-text" }, c.text));
      return;
    }
    const scale = Math.max(1e-6, ...record.completions.map((x) => Math.abs(x.advantage || 0)));
    const gaps = record.completions.flatMap((x) => (Array.isArray(x.gap) ? x.gap : []));
    gapScale = gaps.reduce((top, g) => (typeof g === "number" ? Math.max(top, Math.abs(g)) : top), 1e-12);
    modeChooser(view, state);
    const holder = el("div", { id: "tokens" });
    const turns = Array.isArray(c.turns) ? c.turns : [{ role: null, start: 0, end: c.tokens.length }];
    for (const turn of turns) {
      const block = el("div", { class: turn.role ? "turn " + turn.role : "" });
      if (turn.role) block.appendChild(el("div", { class: "role" }, turn.role === "observation"
        ? "observation (inserted: tool output or messages, never trained on)" : "assistant"));
      const tokens = el("div", { class: "tokens" });
      tokenSpans(tokens, c, turn.start, Math.min(turn.end, c.tokens.length), scale);
      block.appendChild(tokens);
      toolCalls(block, turn);
      holder.appendChild(block);
    }
    view.appendChild(holder);
  }

  function route() {
    let state = parseHash();
    if (state && state.mode) mode = state.mode;
    if (!state) {
      const first = steps("train")[0];
      state = first === undefined ? null : { kind: "train", step: first, group: NaN, index: NaN };
    }
    renderLists(state);
    renderSample(state);
    if (state && !Number.isNaN(state.index)) {
      document.getElementById("sample-view").scrollIntoView({ block: "nearest" });
    }
  }
  window.addEventListener("hashchange", route);
  route();
})();
