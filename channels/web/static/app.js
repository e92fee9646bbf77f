/* chatbridge web chat: plain JavaScript, no build step.
 *
 * Exposes window.chatbridge = {renderMarkdown, escapeHtml, HistoryMirror, app} (the browser test uses them).
 * History rules (same as tests/support/history_mirror.py): apply only the next revision, ignore duplicate message
 * ids, one full fetch on a gap, deltas of other sessions only mark them unread.
 */
"use strict";
(function () {
  // ---- safe Markdown: escape everything first, then add a small, fixed set of tags ----------------------
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  function escapeHtml(s) { return String(s).replace(/[&<>"']/g, (c) => ESC[c]); }

  function renderInline(text) {
    // `text` is raw; every piece that reaches the output goes through escapeHtml. Code spans and links are
    // set aside as placeholders first, so emphasis never reaches inside them.
    const held = [];
    const hold = (html) => { held.push(html); return "\u0000" + (held.length - 1) + "\u0000"; };
    let s = text.replace(/\u0000/g, "");
    s = s.replace(/`([^`\n]+)`/g, (_, code) => hold("<code>" + escapeHtml(code) + "</code>"));
    s = s.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (m, label, url) => {
      if (!/^(https?:\/\/|mailto:)/i.test(url)) return m; // only these schemes become links
      return hold('<a href="' + escapeHtml(url) + '" target="_blank" rel="noopener noreferrer nofollow">' +
                  escapeHtml(label) + "</a>");
    });
    s = escapeHtml(s);
    s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>");
    s = s.replace(/(^|[^_\w])_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => held[Number(i)]);
  }

  function renderMarkdown(src) {
    const lines = String(src).replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let para = [];
    let list = null; // {tag, items}
    const flushPara = () => { if (para.length) { out.push("<p>" + para.map(renderInline).join("<br>") + "</p>"); para = []; } };
    const flushList = () => { if (list) { out.push("<" + list.tag + ">" + list.items.map((i) => "<li>" + renderInline(i) + "</li>").join("") + "</" + list.tag + ">"); list = null; } };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*(```|~~~)\s*([\w+-]*)\s*$/);
      if (fence) {
        flushPara(); flushList();
        const body = [];
        i++;
        while (i < lines.length && !lines[i].trim().startsWith(fence[1])) { body.push(lines[i]); i++; }
        const lang = fence[2] ? ' class="lang-' + escapeHtml(fence[2]) + '"' : "";
        out.push("<pre><code" + lang + ">" + escapeHtml(body.join("\n")) + "</code></pre>");
        continue;
      }
      let m;
      if (!line.trim()) { flushPara(); flushList(); continue; }
      if ((m = line.match(/^(#{1,4})\s+(.*)$/))) {
        flushPara(); flushList();
        out.push("<h" + m[1].length + ">" + renderInline(m[2]) + "</h" + m[1].length + ">");
        continue;
      }
      if ((m = line.match(/^\s*>\s?(.*)$/))) { flushPara(); flushList(); out.push("<blockquote>" + renderInline(m[1]) + "</blockquote>"); continue; }
      if ((m = line.match(/^\s*[-*+]\s+(.*)$/)) || (m = line.match(/^\s*\d+[.)]\s+(.*)$/))) {
        flushPara();
        const tag = /^\s*\d/.test(line) ? "ol" : "ul";
        if (list && list.tag !== tag) flushList();
        if (!list) list = { tag, items: [] };
        list.items.push(m[1]);
        continue;
      }
      flushList();
      para.push(line);
    }
    flushPara(); flushList();
    return out.join("");
  }

  // ---- history mirror ------------------------------------------------------------------------------------
  class HistoryMirror {
    constructor() { this.openSession = null; this.revision = null; this.messages = []; this.ids = new Set(); this.unread = new Set(); this.fetchPending = false; }
    loadFull(session, revision, messages) {
      this.openSession = session; this.revision = revision; this.messages = messages.slice();
      this.ids = new Set(messages.map((m) => m.id)); this.unread.delete(session); this.fetchPending = false;
    }
    applyDelta(session, revision, messages) {
      if (session !== this.openSession) { this.unread.add(session); return "marked_unread"; }
      if (this.revision !== null && revision <= this.revision) return "duplicate";
      if (this.revision === null || revision !== this.revision + 1) {
        if (this.fetchPending) return "duplicate";
        this.fetchPending = true;
        return "needs_full_fetch";
      }
      for (const m of messages) { if (!this.ids.has(m.id)) { this.ids.add(m.id); this.messages.push(m); } }
      this.revision = revision;
      return "applied";
    }
  }

  // ---- the page ------------------------------------------------------------------------------------------
  const $ = (id) => document.getElementById(id);
  const app = {
    mirror: new HistoryMirror(),
    sessions: [],
    session: null,
    live: null,            // the running (or just finished, not yet committed) turn
    pending: new Map(),    // client_id → text of a sent message not yet in history
    notices: [],           // {text, after: id of the last history message when it arrived}
    held: [],              // deltas that arrived while a full fetch was on its way
    decisions: new Map(),  // tool call id → "allow" | "deny" clicked on this page (its buttons stay disabled)
    stream: null,
    feed: null,
    stats: { fullFetches: 0, deltas: { applied: 0, duplicate: 0, needs_full_fetch: 0, marked_unread: 0 } },
  };

  function newClientId() {
    const a = new Uint8Array(12);
    (window.crypto || {}).getRandomValues ? window.crypto.getRandomValues(a) : a.forEach((_, i) => { a[i] = Math.random() * 256; });
    return Array.from(a, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  async function api(method, path, body) {
    const init = { method, headers: {}, credentials: "same-origin" };
    if (body !== undefined) { init.headers["Content-Type"] = "application/json"; init.body = JSON.stringify(body); }
    const resp = await fetch(path, init);
    if (resp.status === 401) { location.href = "/login"; throw new Error("authentication required"); }
    let data = null;
    try { data = await resp.json(); } catch (_) { data = null; }
    if (!resp.ok) throw new Error((data && data.error) || ("HTTP " + resp.status));
    return data;
  }

  function setStatus(text) { $("status").textContent = text; }

  // sessions
  async function loadSessions() {
    const data = await api("GET", "/api/sessions");
    app.sessions = data.sessions;
    renderSessions();
  }
  function renderSessions() {
    const ul = $("sessions");
    ul.textContent = "";
    for (const s of app.sessions) {
      const li = document.createElement("li");
      li.dataset.id = s.id;
      if (s.id === app.session) li.classList.add("active");
      if (app.mirror.unread.has(s.id)) li.classList.add("unread");
      const t = document.createElement("span");
      t.className = "t"; t.textContent = s.title;
      li.appendChild(t);
      li.addEventListener("click", () => { openSession(s.id); $("app").classList.remove("show-sidebar"); });
      ul.appendChild(li);
    }
    const cur = app.sessions.find((s) => s.id === app.session);
    $("title").textContent = cur ? cur.title : "chatbridge";
    document.title = (cur ? cur.title + " · " : "") + "chatbridge";
  }
  function setTitle(id, title) {
    const s = app.sessions.find((x) => x.id === id);
    if (s) s.title = title; else app.sessions.unshift({ id, title });
    renderSessions();
  }
  async function newSession() {
    const s = await api("POST", "/api/sessions");
    if (!app.sessions.find((x) => x.id === s.id)) app.sessions.unshift({ id: s.id, title: s.title });
    openSession(s.id);
  }

  function startRename() {
    if (!app.session) return;
    const h = $("title");
    const input = document.createElement("input");
    input.id = "title-input";
    input.value = h.textContent;
    input.maxLength = 200;
    h.replaceWith(input);
    input.focus(); input.select();
    let done = false;
    const finish = async (save) => {
      if (done) return; done = true;
      input.replaceWith(h);
      const title = input.value.trim();
      if (save && title && title !== h.textContent) {
        try { await api("PATCH", "/api/sessions/" + app.session, { title }); setTitle(app.session, title); } catch (e) { setStatus(e.message); }
      }
    };
    input.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); finish(true); } if (e.key === "Escape") finish(false); });
    input.addEventListener("blur", () => finish(true));
  }

  // history
  let fetching = null;
  async function fullFetch() {
    const id = app.session;
    app.mirror.fetchPending = true;
    app.stats.fullFetches++;
    const p = api("GET", "/api/sessions/" + id + "/history").then((data) => {
      if (app.session !== id) return;
      app.mirror.loadFull(id, data.history_revision, data.messages);
      dropCommittedPending(data.messages);
      const held = app.held; app.held = [];
      if (app.live && app.live.state !== "running") app.live.committed = true; // core commits before the terminal event
      renderHistory();
      for (const d of held) applyCommitted(d);
      settleLive();
      renderLive();
    }).catch((e) => { setStatus(e.message); app.mirror.fetchPending = false; });
    fetching = p;
    return p;
  }
  function dropCommittedPending(messages) {
    for (const m of messages) {
      if (m.role !== "user") continue;
      for (const [cid, text] of app.pending) { if (text === m.content) { app.pending.delete(cid); break; } }
    }
  }

  // stream
  function connect(id) {
    if (app.stream) app.stream.close();
    const es = new EventSource("/api/sessions/" + id + "/stream");
    app.stream = es;
    const on = (name, fn) => es.addEventListener(name, (ev) => { if (app.stream === es) fn(JSON.parse(ev.data)); });
    es.onopen = () => setStatus("");
    es.onerror = () => setStatus(es.readyState === EventSource.CLOSED ? "disconnected" : "reconnecting…");
    on("resync_required", () => { fullFetch(); });
    on("task_state", (d) => {
      app.live = d.turn ? Object.assign({ committed: false }, d.turn) : null;
      if (app.live && d.approvals) app.live.approvals = d.approvals;
      renderLive();
    });
    on("turn", applyTurn);
    on("approval_request", (d) => {
      // The turn event before it listed the approval already; this keeps a page that missed it right.
      const live = app.live;
      if (!live || live.turn_id !== d.turn_id || live.state !== "running") return;
      if (!live.approvals.some((a) => a.call_id === d.call_id)) {
        live.approvals = live.approvals.concat([{ call_id: d.call_id, tool_name: d.tool_name, arguments: d.arguments }]);
        renderLive();
      }
    });
    on("turn_committed", (d) => {
      // Core commits a turn before it shows its terminal state, and one turn runs at a time per session:
      // this delta closes the live turn, whether it is applied now, held, or leads to a full fetch.
      if (app.live && d.session_id === app.session) {
        app.live.committed = true;
        if (app.live.client_id) app.pending.delete(app.live.client_id);
        settleLive();
        renderLive();
      }
      // While a full fetch is on its way, deltas wait for it (older ones then count as duplicates).
      if (app.mirror.fetchPending && d.session_id === app.mirror.openSession) { app.held.push(d); return; }
      applyCommitted(d);
    });
    on("session_title", (d) => setTitle(d.session_id, d.title));
    on("notice", (d) => {
      if (d.client_id) app.pending.delete(d.client_id);
      addNotice(d.text);
    });
  }

  function applyCommitted(d) {
    const r = app.mirror.applyDelta(d.session_id, d.history_revision, d.messages);
    app.stats.deltas[r]++;
    if (r === "needs_full_fetch") { fullFetch(); }
    if (r === "applied") {
      dropCommittedPending(d.messages);
      renderHistory();
    }
  }

  function addNotice(text) {
    const msgs = app.mirror.messages;
    app.notices.push({ text, after: msgs.length ? msgs[msgs.length - 1].id : null });
    renderHistory();
  }

  function applyTurn(d) {
    let live = app.live;
    if (!live || live.turn_id !== d.turn_id) {
      live = app.live = { turn_id: d.turn_id, client_id: d.client_id || null, text: "", state: d.state, tools: [], approvals: [], error: null, committed: false };
    }
    if (d.replace !== undefined) live.text = d.replace;
    if (d.append) live.text += d.append;
    if (d.tools) live.tools = d.tools;
    if (d.approvals) live.approvals = d.approvals;
    if (d.error !== undefined) live.error = d.error;
    live.state = d.state; live.version = d.version;
    settleLive();
    renderLive();
  }

  // A committed turn lives on in history; only its terminal notice (stopped / failed) is added once.
  function settleLive() {
    const live = app.live;
    if (!live || !live.committed || live.state === "running") return;
    if (live.error) addNotice(live.error);
    app.live = null;
  }

  // rendering
  function nearBottom() { const el = $("messages"); return el.scrollHeight - el.scrollTop - el.clientHeight < 80; }
  function scrollDown(force) { const el = $("messages"); if (force) el.scrollTop = el.scrollHeight; }

  function messageEl(m) {
    const div = document.createElement("div");
    div.className = "msg " + m.role + (m.kind === "partial" ? " partial" : "");
    div.dataset.id = m.id;
    if (m.role === "assistant") {
      div.innerHTML = renderMarkdown(m.content);
      if (m.tool_calls && m.tool_calls.length) {
        if (!m.content) div.classList.add("calls-only");
        const ul = document.createElement("ul"); ul.className = "tools";
        for (const c of m.tool_calls) { const li = document.createElement("li"); li.textContent = c.name + " " + argsText(c.arguments); ul.appendChild(li); }
        div.appendChild(ul);
      }
    } else div.textContent = m.content;
    return div;
  }
  function argsText(raw) {
    let s = String(raw || "");
    try { const v = JSON.parse(s); s = v && typeof v === "object" && !Array.isArray(v) ? Object.keys(v).map((k) => k + "=" + JSON.stringify(v[k])).join(", ") : JSON.stringify(v); } catch (_) { /* shown as sent */ }
    return "(" + (s.length > 160 ? s.slice(0, 159) + "…" : s) + ")";
  }
  // A tool's result in history: one muted line under the call (a denial reads as such).
  function toolResultEl(m, name) {
    const div = document.createElement("div");
    const denied = /^Tool call denied/.test(m.content);
    div.className = "tool-result" + (denied ? " denied" : "");
    div.dataset.id = m.id;
    const text = m.content.length > 300 ? m.content.slice(0, 299) + "…" : m.content;
    div.textContent = (name || "tool") + " → " + text;
    return div;
  }
  function noticeEl(text) { const d = document.createElement("div"); d.className = "notice"; d.textContent = text; return d; }

  function renderHistory() {
    const stick = nearBottom();
    const box = $("messages");
    box.textContent = "";
    const byAfter = new Map();
    for (const n of app.notices) { if (!byAfter.has(n.after)) byAfter.set(n.after, []); byAfter.get(n.after).push(n); }
    for (const n of byAfter.get(null) || []) box.appendChild(noticeEl(n.text));
    const toolNames = new Map();
    for (const m of app.mirror.messages) {
      if (m.role === "user" || m.role === "assistant") box.appendChild(messageEl(m));
      if (m.role === "assistant") for (const c of m.tool_calls || []) toolNames.set(c.id, c.name);
      if (m.role === "tool") box.appendChild(toolResultEl(m, toolNames.get(m.tool_call_id)));
      for (const n of byAfter.get(m.id) || []) box.appendChild(noticeEl(n.text));
    }
    for (const [cid, text] of app.pending) {
      const d = document.createElement("div"); d.className = "msg user pending"; d.dataset.clientId = cid; d.textContent = text; box.appendChild(d);
    }
    const liveBox = document.createElement("div"); liveBox.id = "live"; box.appendChild(liveBox);
    renderSessions();
    renderLive();
    scrollDown(stick);
  }

  function renderLive() {
    const stick = nearBottom();
    const holder = $("live");
    if (!holder) return;
    holder.textContent = "";
    const live = app.live;
    const running = !!(live && live.state === "running");
    $("stop").hidden = !running;
    if (live && !live.committed) {
      const div = document.createElement("div");
      div.className = "msg assistant live" + (running ? " typing" : "");
      div.dataset.turn = live.turn_id;
      const body = document.createElement("div");
      body.className = "body";
      body.innerHTML = renderMarkdown(live.text);
      div.appendChild(body);
      if (live.tools && live.tools.length) {
        const ul = document.createElement("ul"); ul.className = "tools";
        for (const t of live.tools) { const li = document.createElement("li"); li.className = t.status; li.textContent = t.name + " — " + t.status.replace("_", " ") + (t.summary ? ": " + t.summary : ""); ul.appendChild(li); }
        div.appendChild(ul);
      }
      for (const a of (running && live.approvals) || []) div.appendChild(approvalEl(a));
      if (live.error) { const e = document.createElement("div"); e.className = "turn-error"; e.textContent = live.error; div.appendChild(e); }
      holder.appendChild(div);
    }
    scrollDown(stick);
  }

  // approvals: Allow / Deny under the live turn; a click disables both until the turn events move on
  function approvalEl(a) {
    const box = document.createElement("div");
    box.className = "approval";
    box.dataset.callId = a.call_id;
    const q = document.createElement("div"); q.className = "q";
    const name = document.createElement("strong"); name.textContent = a.tool_name;
    q.append("Run ", name, "?");
    box.appendChild(q);
    if (a.arguments) { const args = document.createElement("code"); args.className = "args"; args.textContent = a.arguments; box.appendChild(args); }
    const chosen = app.decisions.get(a.call_id);
    const row = document.createElement("div"); row.className = "buttons";
    for (const [decision, label] of [["allow", "Allow"], ["deny", "Deny"]]) {
      const b = document.createElement("button");
      b.type = "button"; b.className = decision; b.textContent = label; b.disabled = !!chosen;
      b.addEventListener("click", () => decide(a.call_id, decision));
      row.appendChild(b);
    }
    if (chosen) { const s = document.createElement("span"); s.className = "chosen"; s.textContent = chosen === "allow" ? "Allowing…" : "Denying…"; row.appendChild(s); }
    box.appendChild(row);
    return box;
  }
  async function decide(callId, decision) {
    if (!app.session || app.decisions.has(callId)) return;
    const sid = app.session;
    app.decisions.set(callId, decision);
    renderLive();
    try {
      await api("POST", "/api/sessions/" + sid + "/approvals/" + encodeURIComponent(callId), { decision });
    } catch (e) {
      if (app.session !== sid) return;
      app.decisions.delete(callId);
      addNotice("⚠️ The " + decision + " was not recorded: " + e.message);
    }
  }

  // sending
  async function send(text) {
    if (!app.session || !text.trim()) return;
    const cid = newClientId();
    if (!text.trim().startsWith("/")) app.pending.set(cid, text);
    renderHistory(); scrollDown(true);
    try {
      await api("POST", "/api/sessions/" + app.session + "/messages", { text, client_id: cid });
    } catch (e) {
      app.pending.delete(cid);
      addNotice("⚠️ Not sent: " + e.message);
    }
  }

  function openSession(id) {
    app.session = id;
    history.replaceState(null, "", "#" + id);
    app.live = null; app.pending.clear(); app.notices = []; app.held = []; app.decisions.clear();
    app.mirror.loadFull(id, null, []);
    app.mirror.revision = null;
    renderHistory();
    connect(id);
    return fullFetch();
  }

  function connectFeed() {
    const es = new EventSource("/api/events");
    app.feed = es;
    es.addEventListener("session_activity", (ev) => {
      const d = JSON.parse(ev.data);
      // The open session's deltas come (with their messages) on its own stream.
      if (d.session_id !== app.session) { app.stats.deltas[app.mirror.applyDelta(d.session_id, d.history_revision, [])]++; renderSessions(); }
    });
    es.addEventListener("session_title", (ev) => { const d = JSON.parse(ev.data); setTitle(d.session_id, d.title); });
    es.addEventListener("session_created", (ev) => { const d = JSON.parse(ev.data); if (!app.sessions.find((s) => s.id === d.session_id)) { app.sessions.unshift({ id: d.session_id, title: d.title }); renderSessions(); } });
  }

  async function start() {
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); const t = $("input").value; $("input").value = ""; send(t); });
    $("input").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); } });
    $("stop").addEventListener("click", () => { if (app.session) api("POST", "/api/sessions/" + app.session + "/stop").catch((e) => setStatus(e.message)); });
    $("new-chat").addEventListener("click", () => newSession().catch((e) => setStatus(e.message)));
    $("rename").addEventListener("click", startRename);
    $("toggle-sidebar").addEventListener("click", () => $("app").classList.toggle("show-sidebar"));
    try {
      await loadSessions();
      const wanted = location.hash.slice(1);
      if (wanted && /^[A-Za-z0-9_-]{1,64}$/.test(wanted)) {
        if (!app.sessions.find((s) => s.id === wanted)) app.sessions.unshift({ id: wanted, title: "New chat" });
        await openSession(wanted);
      } else if (app.sessions.length) await openSession(app.sessions[0].id);
      else await newSession();
      connectFeed();
      document.body.dataset.ready = "1";
    } catch (e) { setStatus(e.message); }
  }

  window.chatbridge = { renderMarkdown, escapeHtml, HistoryMirror, app, openSession, fullFetch };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
})();
