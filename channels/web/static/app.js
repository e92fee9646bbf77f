/* chatbridge web chat: plain JavaScript, no build step.
 *
 * Model output is Markdown, rendered by markdown-it with raw HTML off (HTML in a reply is shown as text),
 * links only to http(s) and mailto, and images shown as links (never loaded: an image URL written by a model
 * could carry data out of the chat). DOMPurify then keeps only the tags and attributes markdown-it emits.
 * Code blocks with a known language are highlighted by highlight.js and every code block gets a Copy button.
 * The libraries are files under /static/vendor (see the README there); the page uses no inline script,
 * no inline event handler and no eval, so it runs under a strict Content-Security-Policy.
 *
 * Streaming stays cheap: text is rendered per top-level block and a block whose source did not change is
 * neither rendered, sanitized, highlighted nor put into the page again; code is highlighted once per text;
 * and a live reply is re-rendered at most as often as its last render cost allows, so a long reply never
 * freezes the page.
 *
 * Exposes window.chatbridge = {renderMarkdown, HistoryMirror, app, ...} (the browser tests use them).
 * History rules (same as tests/support/history_mirror.py): apply only the next revision, ignore duplicate message
 * ids, one full fetch on a gap, deltas of other sessions only mark them unread; older pages are prepended
 * only when they end right before the oldest message held.
 */
"use strict";
(function () {
  // ---- Markdown -------------------------------------------------------------------------------------------
  const PAGE = 100;        // messages per history request
  const LINK_OK = /^(https?:|mailto:)/i;
  const HIGHLIGHT_CACHE_CHARS = 2000000;
  const highlighted = new Map();  // language + "\0" + code → highlighted HTML (insertion order = age)
  let highlightedChars = 0;
  const stats = { highlightCalls: 0, liveRenders: 0, liveRenderMs: 0, liveRenderMaxMs: 0 };

  function highlightCode(code, lang) {
    const name = String(lang || "").trim().split(/\s+/)[0].toLowerCase();
    const hljs = window.hljs;
    if (!name || !hljs || !hljs.getLanguage(name)) return ""; // markdown-it escapes it as plain text
    const key = name + "\u0000" + code;
    let html = highlighted.get(key);
    if (html === undefined) {
      stats.highlightCalls++;
      try { html = hljs.highlight(code, { language: name, ignoreIllegals: true }).value; } catch (_) { html = ""; }
      highlighted.set(key, html);
      highlightedChars += key.length + html.length;
      for (const [k, v] of highlighted) { // oldest first; a growing (streamed) block leaves many versions
        if (highlightedChars <= HIGHLIGHT_CACHE_CHARS) break;
        highlighted.delete(k); highlightedChars -= k.length + v.length;
      }
    }
    return html;
  }

  const md = window.markdownit({ html: false, linkify: true, breaks: true, highlight: highlightCode });
  md.validateLink = (url) => LINK_OK.test(String(url).trim());
  // An image becomes a link labelled with its description: nothing is fetched unless the user clicks.
  md.renderer.rules.image = (tokens, idx, options, env, self) => {
    const t = tokens[idx];
    const label = self.renderInlineAsText(t.children, options, env) || "image";
    return '<a href="' + md.utils.escapeHtml(t.attrGet("src") || "") + '">' + md.utils.escapeHtml("image: " + label) + "</a>";
  };
  // Table alignment as a class, not a style attribute (styles stay out of rendered output).
  const cellOpen = (tokens, idx, options, env, self) => {
    const t = tokens[idx];
    const m = /text-align:(left|right|center)/.exec(t.attrGet("style") || "");
    if (t.attrs) t.attrs = t.attrs.filter((a) => a[0] !== "style");
    if (m) t.attrJoin("class", "align-" + m[1]);
    return self.renderToken(tokens, idx, options);
  };
  md.renderer.rules.th_open = cellOpen;
  md.renderer.rules.td_open = cellOpen;

  const PURIFY = {
    ALLOWED_TAGS: ["p", "br", "strong", "em", "s", "code", "pre", "blockquote", "ul", "ol", "li", "hr",
                   "h1", "h2", "h3", "h4", "h5", "h6", "table", "thead", "tbody", "tr", "th", "td", "a", "span"],
    ALLOWED_ATTR: ["href", "title", "class", "start"],
    ALLOWED_URI_REGEXP: /^(?:https?:|mailto:)/i,
    ALLOW_DATA_ATTR: false,
  };
  window.DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") { node.setAttribute("target", "_blank"); node.setAttribute("rel", "noopener noreferrer nofollow"); }
  });

  // A reply is rendered per top-level block (paragraph, list, table, code block, ...). The whole text is
  // parsed every time, so the structure is exactly that of one full render, but a block whose source did not
  // change reuses its sanitized rendering (cloned), and an element keeps the nodes of its unchanged leading
  // blocks: while a reply streams, only its last block is rendered, sanitized and put into the page again.
  const BLOCK_CACHE_CHARS = 4000000;
  const blockCache = new Map();  // key (block kind, references, source lines) → sanitized DocumentFragment
  let blockCacheChars = 0;
  const blockState = new WeakMap();  // element → [{key, nodes}] of the blocks it shows

  function markdownBlocks(src) {
    const text = String(src).replace(/\r\n?/g, "\n").replace(/\u0000/g, "\uFFFD"); // as markdown-it sees it
    const env = {};
    const tokens = md.parse(text, env);
    const lines = text.split("\n");
    // a block's rendering depends on every definition's target, not only its label: a definition still
    // streaming in ("https://example.org/" before "ref") must not leave the links above it stale
    const refs = env.references
      ? Object.entries(env.references).map(([label, ref]) => [label, ref.href, ref.title || ""].join("\u0002")).join("\u0001")
      : "";
    const blocks = [];
    for (let i = 0; i < tokens.length;) {
      const start = i;
      let depth = 0;
      do { depth += tokens[i].nesting; i++; } while (depth > 0 && i < tokens.length);
      const first = tokens[start];
      const map = first.map || [0, 0];
      const key = first.type + "\u0000" + refs + "\u0000" + lines.slice(map[0], map[1]).join("\n");
      blocks.push({ key, tokens: tokens.slice(start, i), env });
    }
    return blocks;
  }

  function blockFragment(block) {
    let frag = blockCache.get(block.key);
    if (frag === undefined) {
      const html = md.renderer.render(block.tokens, md.options, block.env);
      frag = window.DOMPurify.sanitize(html, Object.assign({ RETURN_DOM_FRAGMENT: true }, PURIFY));
      blockCache.set(block.key, frag);
      blockCacheChars += block.key.length;
      for (const k of blockCache.keys()) { // oldest first; a streamed block leaves many versions behind
        if (blockCacheChars <= BLOCK_CACHE_CHARS) break;
        blockCache.delete(k); blockCacheChars -= k.length;
      }
    }
    return frag.cloneNode(true);
  }

  /** Model Markdown → sanitized HTML (a string; the page itself uses fillMarkdown). */
  function renderMarkdown(src) {
    const div = document.createElement("div");
    for (const block of markdownBlocks(src)) div.appendChild(blockFragment(block));
    return div.innerHTML;
  }

  /** Show Markdown `src` in `el`, keeping the nodes of the blocks `el` already shows unchanged. */
  function fillMarkdown(el, src) {
    const blocks = markdownBlocks(src);
    const shown = blockState.get(el) || [];
    let same = 0;
    while (same < shown.length && same < blocks.length && shown[same].key === blocks[same].key) same++;
    for (const old of shown.slice(same)) for (const n of old.nodes) n.remove();
    const kept = shown.slice(0, same);
    for (const block of blocks.slice(same)) {
      const frag = blockFragment(block);
      addCopyButtons(frag);
      kept.push({ key: block.key, nodes: Array.from(frag.childNodes) });
      el.appendChild(frag);
    }
    blockState.set(el, kept);
  }

  function addCopyButtons(root) {
    for (const pre of root.querySelectorAll("pre")) {
      const code = pre.querySelector("code");
      if (!code) continue;
      const box = document.createElement("div");
      box.className = "code";
      const b = document.createElement("button");
      b.type = "button"; b.className = "copy"; b.textContent = "Copy"; b.title = "Copy this code";
      b.addEventListener("click", () => copyText(code.textContent, b));
      pre.replaceWith(box);
      box.append(pre, b);
    }
  }

  async function copyText(text, button) {
    let ok = false;
    try {
      await navigator.clipboard.writeText(text);
      ok = true;
    } catch (_) {
      ok = legacyCopy(text); // plain http on a LAN address is not a secure context: no Clipboard API there
    }
    button.textContent = ok ? "Copied" : "Copy failed";
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  }
  function legacyCopy(text) {
    const ta = document.createElement("textarea");
    ta.className = "clipboard-helper"; ta.value = text; ta.readOnly = true;
    document.body.appendChild(ta);
    ta.select();
    let ok = false;
    try { ok = document.execCommand("copy"); } catch (_) { ok = false; }
    ta.remove();
    return ok;
  }

  // ---- history mirror ------------------------------------------------------------------------------------
  class HistoryMirror {
    constructor() { this.openSession = null; this.revision = null; this.messages = []; this.ids = new Set(); this.unread = new Set(); this.fetchPending = false; this.hasMore = false; }
    // First load, reconnect miss, gap recovery or a session switch. The newest page replaces what is held,
    // except that older pages already loaded stay when the new page overlaps them (history only grows).
    // An answer older than the revision held (a slower fetch overtaken by a newer one) changes nothing: false.
    loadFull(session, revision, messages, hasMore) {
      if (session === this.openSession && this.revision !== null && revision !== null && revision < this.revision) {
        this.fetchPending = false;
        return false;
      }
      let kept = [];
      let more = !!hasMore;
      if (session === this.openSession && messages.length) {
        const at = this.messages.findIndex((m) => m.id === messages[0].id);
        if (at >= 0) { kept = this.messages.slice(0, at); more = this.hasMore; }
      }
      this.openSession = session; this.revision = revision; this.messages = kept.concat(messages);
      this.ids = new Set(this.messages.map((m) => m.id)); this.unread.delete(session); this.fetchPending = false;
      this.hasMore = more;
      return true;
    }
    // An older page asked for with before=<the oldest message held>; false when that no longer fits.
    loadOlder(session, before, messages, hasMore) {
      if (session !== this.openSession || !this.messages.length || this.messages[0].id !== before) return false;
      const older = messages.filter((m) => !this.ids.has(m.id));
      for (const m of older) this.ids.add(m.id);
      this.messages = older.concat(this.messages);
      this.hasMore = !!hasMore;
      return true;
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
    pending: new Map(),    // client_id → {text, files} of a sent message not yet in history
    sentIds: new Set(),    // every client_id this page posted: the notices meant for its sender only
    outgoing: [],          // files attached to the next message: {key, name, ref (once uploaded), failed}
    notices: [],           // {text, after: id of the last history message when it arrived}
    held: [],              // deltas that arrived while a full fetch was on its way
    decisions: new Map(),  // approval key (origin + call id) → "allow" | "deny" clicked here (buttons stay disabled)
    cardOpen: new Map(),   // subagent session id → whether its card is open (kept across renders)
    stream: null,          // the one EventSource: the open session's events and the conversation-list feed
    refetch: false,        // fetch the history again once the fetch on its way is done (see turnEnded)
    revisions: new Map(),  // session id → the newest history revision this page heard of (list, feed, history)
    loadingOlder: false,   // an older history page is on its way
    rendered: new Map(),   // message key → its element (stored messages never change: rendered once)
    liveView: null,        // {turnId, div, body, extra}: the element of the live reply
    stats: Object.assign(stats, { fullFetches: 0, olderPages: 0,
                                  deltas: { applied: 0, duplicate: 0, needs_full_fetch: 0, marked_unread: 0 } }),
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
    if (!resp.ok) throw Object.assign(new Error((data && data.error) || ("HTTP " + resp.status)), { status: resp.status });
    return data;
  }

  function setStatus(text) { $("status").textContent = text; }

  // sessions
  // The whole list, merged with what the stream told while it was on its way (a new conversation, a new
  // title: at least as new as the answer); the open conversation stays listed even before its first message.
  // A conversation that moved on while the stream was away (its revision rose unheard) is marked unread.
  async function loadSessions() {
    const before = new Map(app.sessions.map((s) => [s.id, s.title]));
    const data = await api("GET", "/api/sessions");
    for (const s of data.sessions) {
      const known = app.revisions.get(s.id);
      if (known !== undefined && s.history_revision > known && s.id !== app.session) app.mirror.unread.add(s.id);
      heard(s.id, s.history_revision);
    }
    const told = new Map(app.sessions.filter((s) => before.get(s.id) !== s.title).map((s) => [s.id, s]));
    const listed = new Set(data.sessions.map((s) => s.id));
    const current = app.sessions.find((s) => s.id === app.session && !listed.has(s.id));
    if (current) told.set(current.id, current);
    const fresh = [...told.values()].filter((s) => !listed.has(s.id));
    app.sessions = fresh.concat(data.sessions.map((s) => (told.has(s.id) ? Object.assign({}, s, { title: told.get(s.id).title }) : s)));
    renderSessions();
  }
  function heard(id, revision) {
    if (typeof revision === "number" && !(app.revisions.get(id) >= revision)) app.revisions.set(id, revision);
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
  // One full fetch at a time per conversation: a reason for another while one is on its way (a resync, a
  // gap) fetches once more when it is done, so an older answer never lands after a newer one (and the
  // mirror refuses an answer older than what it holds).
  let fetching = null;      // {id, promise} of the full fetch on its way
  let fetchAgain = false;   // fetch once more when it is done
  function fullFetch() {
    const id = app.session;
    app.mirror.fetchPending = true;
    if (fetching && fetching.id === id) { fetchAgain = true; return fetching.promise; }
    fetchAgain = false;
    app.stats.fullFetches++;
    const mine = { id, promise: null };
    fetching = mine;
    mine.promise = api("GET", "/api/sessions/" + id + "/history?limit=" + PAGE).then((data) => {
      if (app.session !== id) return;
      if (app.mirror.loadFull(id, data.history_revision, data.messages, data.has_more)) {
        heard(id, data.history_revision);
        dropCommittedPending(data.messages);
        for (const p of app.pending.values()) if (p.session === id && p.afterSeq === null) p.afterSeq = newestSeq();
      }
      const held = app.held; app.held = [];
      markCommitted();
      renderHistory();
      for (const d of held) applyCommitted(d);
      settleLive();
      renderLive();
      if (app.refetch && !app.mirror.fetchPending) { app.refetch = false; if (app.live && app.live.state !== "running" && !app.live.committed) fetchAgain = true; }
    }).catch((e) => { setStatus(e.message); if (app.session === id) app.mirror.fetchPending = false; app.refetch = false; })
      .finally(() => {
        if (fetching !== mine) return;
        fetching = null;
        if (fetchAgain && app.session === id) fullFetch();
      });
    return mine.promise;
  }
  // Older messages, when the top of the conversation is reached (the scroll position stays where it was).
  async function loadOlder() {
    const mirror = app.mirror;
    const id = app.session;
    if (app.loadingOlder || !mirror.hasMore || mirror.fetchPending || !mirror.messages.length || mirror.openSession !== id) return;
    const before = mirror.messages[0].id;
    app.loadingOlder = true;
    renderTop();
    try {
      const data = await api("GET", "/api/sessions/" + id + "/history?limit=" + PAGE + "&before=" + encodeURIComponent(before));
      if (app.session === id && mirror.loadOlder(id, before, data.messages, data.has_more)) {
        app.stats.olderPages++;
        app.loadingOlder = false;
        renderHistory({ keepPosition: true });
      }
    } catch (e) {
      setStatus(e.message);
    } finally {
      app.loadingOlder = false;
      renderTop();
    }
  }
  function nearTop() { return $("messages").scrollTop < 120; }
  function maybeLoadOlder() { if (app.mirror.hasMore && !app.loadingOlder && nearTop()) loadOlder(); }

  // A message this page sent is in history once a user message names its client_id. A message whose
  // client_id the server no longer knows (null: it was answered by a process that has since restarted) is
  // matched by its text, but only with a message stored after the newest one this page held when sending.
  function dropCommittedPending(messages) {
    for (const m of messages) {
      if (m.role !== "user") continue;
      if (m.client_id) { app.pending.delete(m.client_id); continue; }
      for (const [cid, p] of app.pending) {
        if (p.session === app.session && p.state !== "unsent" && p.afterSeq !== null && p.text === m.content && typeof m.seq === "number" && m.seq > p.afterSeq) { app.pending.delete(cid); break; }
      }
    }
  }

  // The messages waiting for their turn (task_state's queued, and each message_queued event: sent from this
  // tab, another one, an API client, or before a reload) show as sent, greyed like this page's own, once each (by client_id); like those, a message leaves
  // app.pending when the history holds it (or /new's notice marks it not answered). True when one was added.
  function adoptQueued(session, queued) {
    let added = false;
    for (const q of queued) {
      if (!q || !q.client_id || app.pending.has(q.client_id) || session !== app.session) continue;
      if (app.mirror.messages.some((m) => m.role === "user" && m.client_id === q.client_id)) continue;
      // afterSeq (for matching by text, when the history no longer knows the client_id): set once the
      // history is loaded, as the message is stored after everything in it
      app.pending.set(q.client_id, { session, text: q.text || "", files: q.attachments || [], state: "queued", note: "",
                                     command: false, afterSeq: app.mirror.revision === null ? null : newestSeq(), notice: null });
      added = true;
    }
    return added;
  }

  // stream
  // One EventSource per page (a browser opens at most 6 connections per host over HTTP/1.1, shared by all
  // its tabs): the open session's stream, which with feed=1 also carries the conversation-list feed. Its
  // feed events have no id, so they leave the Last-Event-ID of a reconnect alone; what the list missed while
  // the stream was away is fetched again at every (re)open.
  function connect(id) {
    if (app.stream) app.stream.close();
    const es = new EventSource("/api/sessions/" + id + "/stream?feed=1");
    app.stream = es;
    const on = (name, fn) => es.addEventListener(name, (ev) => { if (app.stream === es) fn(JSON.parse(ev.data)); });
    es.onopen = () => {
      if (app.stream !== es) return;
      setStatus("");
      loadSessions().catch((e) => setStatus(e.message));
    };
    es.onerror = () => {
      if (es.readyState !== EventSource.CLOSED) { setStatus("reconnecting…"); return; }
      // The browser gives up on an error answer (e.g. a proxy's 502 while the bridge restarts). A new
      // stream cannot resume where this one stopped, so it starts afresh and the history is fetched again.
      setStatus("disconnected; retrying…");
      setTimeout(() => { if (app.stream === es && app.session === id) { connect(id); fullFetch(); } }, 3000);
    };
    on("resync_required", () => { fullFetch(); });
    on("task_state", (d) => {
      // a turn this page saw committed stays so (its delta may wait for a full fetch)
      const was = app.live;
      const committed = !!(was && d.turn && was.turn_id === d.turn.turn_id && was.committed);
      app.live = d.turn ? Object.assign({ committed }, d.turn) : null;
      if (app.live && d.approvals) app.live.approvals = d.approvals;
      if (app.live) app.live.children = new Map((d.children || []).map((c) => [childKey(c.origin), Object.assign({ newRequest: false }, c)]));
      markCommitted(); // opened between the turn's commit and its terminal event: the answer is in history
      if (adoptQueued(d.session_id, d.queued || [])) renderHistory(); else renderLive();
    });
    on("message_queued", (d) => { if (adoptQueued(d.session_id, [d])) renderHistory(); });
    on("subagent", applySubagent);
    on("turn", applyTurn);
    on("approval_request", (d) => {
      // The turn event before it listed the approval already; this keeps a page that missed it right.
      const live = app.live;
      if (!live || live.turn_id !== d.turn_id || live.state !== "running") return;
      const key = approvalKey(d);
      if (!live.approvals.some((a) => approvalKey(a) === key)) {
        const a = { call_id: d.call_id, tool_name: d.tool_name, arguments: d.arguments };
        if (d.origin) Object.assign(a, { origin: d.origin, label: d.label });
        live.approvals = live.approvals.concat([a]);
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
    on("session_title", (d) => setTitle(d.session_id, d.title)); // the session's own, and the feed's
    on("notice", messageNotice);
    // the conversation-list feed
    on("session_activity", (d) => {
      // The open session's deltas come (with their messages) on its own stream.
      if (d.session_id !== app.session && !(app.revisions.get(d.session_id) >= d.history_revision)) { app.stats.deltas[app.mirror.applyDelta(d.session_id, d.history_revision, [])]++; renderSessions(); }
      heard(d.session_id, d.history_revision);
    });
    on("session_created", (d) => {
      heard(d.session_id, 0); // a new conversation starts at revision 0
      if (!app.sessions.find((s) => s.id === d.session_id)) { app.sessions.unshift({ id: d.session_id, title: d.title }); renderSessions(); }
    });
  }

  function applyCommitted(d) {
    const r = app.mirror.applyDelta(d.session_id, d.history_revision, d.messages);
    app.stats.deltas[r]++;
    if (r === "needs_full_fetch") { fullFetch(); }
    if (r === "applied") {
      heard(d.session_id, d.history_revision);
      dropCommittedPending(d.messages);
      renderHistory();
      if (markCommitted()) renderLive();
    }
  }

  function addNotice(text) {
    const msgs = app.mirror.messages;
    app.notices.push({ text, after: msgs.length ? msgs[msgs.length - 1].id : null });
    renderHistory();
  }

  function liveTurn(turnId, d) {
    let live = app.live;
    if (!live || live.turn_id !== turnId) {
      live = app.live = { turn_id: turnId, client_id: d.client_id || null, text: "", state: d.state || "running", tools: [], approvals: [], error: null, committed: false, children: new Map() };
      markCommitted(); // e.g. a replayed event of a turn the history already holds
    }
    return live;
  }

  // The live turn is committed once the history holds it: a message of that turn other than the user's (which
  // carries the turn's id from the start). Then the history shows it and its live bubble is hidden, so the
  // reply shows once whichever came first: the history, the turn_committed delta or the task_state.
  function markCommitted() {
    const live = app.live;
    if (!live || live.committed || app.mirror.openSession !== app.session) return false;
    const msgs = app.mirror.messages;
    let i = msgs.length - 1;
    while (i >= 0 && !(msgs[i].turn_id === live.turn_id && msgs[i].role !== "user")) i--;
    if (i < 0) return false;
    live.committed = true;
    if (live.client_id) app.pending.delete(live.client_id);
    return true;
  }

  // A turn ended whose commit this page has not seen: its stream opened after the commit (the delta is not
  // replayed to a fresh connection) and the history may have been fetched before it. The terminal event
  // comes after the commit, so a fetch started now finds it.
  function turnEnded(live) {
    if (live.committed || markCommitted()) return;
    if (app.mirror.fetchPending) app.refetch = true; else fullFetch();
  }

  // subagents: each child session of the live turn is a card, fed by the child's own events (its origin
  // says which card; a card's own children have a longer origin)
  function childKey(origin) { return (origin || []).join("/"); }
  function approvalKey(a) { return childKey(a.origin) + "|" + a.call_id; }
  function applySubagent(d) {
    if (d.session_id !== app.session) return;
    const live = liveTurn(d.turn_id, {});
    if (live.committed) return;
    const ev = d.event;
    if (ev.kind === "session_meta") {
      live.children.set(childKey(d.origin), { origin: d.origin, session_id: ev.session_id, profile: ev.profile, task: ev.task, state: "running", text: "", tools: [], error: null, newRequest: false });
    } else if (ev.kind === "subagent") {
      const c = live.children.get(childKey(d.origin.concat([ev.session_id])));
      if (c) { c.state = ev.outcome; c.error = ev.error; }
    } else {
      const c = live.children.get(childKey(d.origin));
      if (c) applyChildEvent(c, ev);
    }
    scheduleLive();
  }
  function applyChildEvent(c, ev) {
    const tool = (id) => c.tools.find((t) => t.call_id === id);
    if (ev.kind === "request_begin") c.newRequest = !!c.text;
    else if (ev.kind === "partial_text" && ev.phase === "delta") {
      if (c.newRequest) { c.text += "\n\n"; c.newRequest = false; }
      c.text += ev.text || "";
    } else if (ev.kind === "tool_call") c.tools.push({ call_id: ev.call_id, name: ev.name, status: "awaiting_approval" });
    else if (ev.kind === "approval_decision") { const t = tool(ev.call_id); if (t) t.status = ev.decision === "allow" ? "running" : "denied"; }
    else if (ev.kind === "tool_call_output") { const t = tool(ev.call_id); if (t) t.status = ev.status; }
    else if (ev.kind === "abort") c.state = "cancelled";
  }
  function cardEl(c, approvals, running) {
    const det = document.createElement("details");
    det.className = "subagent " + c.state;
    det.dataset.session = c.session_id;
    det.dataset.depth = String(Math.min(c.origin.length, 3)); // a nested subagent is indented under its parent
    det.open = app.cardOpen.has(c.session_id) ? app.cardOpen.get(c.session_id) : true;
    det.addEventListener("toggle", () => app.cardOpen.set(c.session_id, det.open));
    const sum = document.createElement("summary");
    const name = document.createElement("strong"); name.textContent = c.profile || "subagent";
    const state = document.createElement("span"); state.className = "state"; state.textContent = c.state;
    sum.append("🤖 ", name, ": " + c.task + " ", state);
    const body = document.createElement("div"); body.className = "body";
    fillMarkdown(body, c.text);
    det.append(sum, body);
    if (c.tools.length) {
      const ul = document.createElement("ul"); ul.className = "tools";
      for (const t of c.tools) { const li = document.createElement("li"); li.className = t.status; li.textContent = t.name + " — " + t.status.replace("_", " "); ul.appendChild(li); }
      det.appendChild(ul);
    }
    for (const a of (running && approvals) || []) det.appendChild(approvalEl(a));
    if (c.error && c.state !== "completed") { const e = document.createElement("div"); e.className = "turn-error"; e.textContent = c.error; det.appendChild(e); }
    return det;
  }
  // A finished subagent in history: its card (closed) with the answer its parent got; opening it loads
  // the child's own conversation once.
  function subagentHistoryEl(m) {
    const s = m.subagent;
    const det = document.createElement("details");
    det.className = "subagent " + s.outcome;
    det.dataset.id = m.id; det.dataset.session = s.session_id;
    const sum = document.createElement("summary");
    const name = document.createElement("strong"); name.textContent = s.profile || "subagent";
    const state = document.createElement("span"); state.className = "state"; state.textContent = s.outcome;
    sum.append("🤖 ", name, ": " + s.task + " ", state);
    const body = document.createElement("div"); body.className = "body";
    fillMarkdown(body, m.content);
    const conv = document.createElement("div"); conv.className = "child-history";
    det.append(sum, body, conv);
    det.addEventListener("toggle", () => {
      if (!det.open || conv.dataset.loaded) return;
      conv.dataset.loaded = "1";
      api("GET", "/api/sessions/" + encodeURIComponent(s.session_id) + "/history").then((h) => {
        const names = new Map();
        const els = [];
        for (const cm of h.messages) {
          if (cm.role === "assistant") for (const c of cm.tool_calls || []) names.set(c.id, c.name);
          els.push(messageEl(cm, cm.role === "tool" ? names.get(cm.tool_call_id) || "" : ""));
        }
        conv.replaceChildren(...els);
        body.hidden = els.length > 0; // the conversation ends with the same answer
      }).catch((e) => { conv.textContent = "⚠️ " + e.message; delete conv.dataset.loaded; });
    });
    return det;
  }

  function applyTurn(d) {
    const live = liveTurn(d.turn_id, d);
    if (d.client_id && !live.client_id) live.client_id = d.client_id; // a subagent's event may have come first
    if (d.replace !== undefined) live.text = d.replace;
    if (d.append) live.text += d.append;
    if (d.tools) live.tools = d.tools;
    if (d.approvals) live.approvals = d.approvals;
    if (d.error !== undefined) live.error = d.error;
    live.state = d.state; live.version = d.version;
    if (d.state !== "running") turnEnded(live);
    settleLive();
    if (d.state === "running") scheduleLive(); else renderLive(); // the end of a turn shows at once
  }

  // A committed turn lives on in history, its terminal notice (stopped / failed) included.
  function settleLive() {
    const live = app.live;
    if (!live || !live.committed || live.state === "running") return;
    app.live = null;
  }

  // rendering
  function nearBottom() { const el = $("messages"); return el.scrollHeight - el.scrollTop - el.clientHeight < 80; }
  function scrollDown(force) { const el = $("messages"); if (force) el.scrollTop = el.scrollHeight; }

  function messageEl(m, toolName) {
    if (m.kind === "notice") return noticeEl(m.content); // the bridge's words (failed, stopped, restarted)
    if (m.role === "tool") return m.subagent ? subagentHistoryEl(m) : toolResultEl(m, toolName);
    const div = document.createElement("div");
    div.className = "msg " + m.role + (m.kind === "partial" ? " partial" : "");
    div.dataset.id = m.id;
    if (m.role === "assistant") {
      const body = document.createElement("div");
      body.className = "body";
      fillMarkdown(body, m.content);
      div.appendChild(body);
      if (m.tool_calls && m.tool_calls.length) {
        if (!m.content) div.classList.add("calls-only");
        const ul = document.createElement("ul"); ul.className = "tools";
        for (const c of m.tool_calls) { const li = document.createElement("li"); li.textContent = c.name + " " + argsText(c.arguments); ul.appendChild(li); }
        div.appendChild(ul);
      }
    } else {
      div.textContent = m.content;
      if (m.attachments && m.attachments.length) div.appendChild(attachmentsEl(m.attachments));
    }
    return div;
  }
  // The files of a user message: images as previews, other files as download links, unread ones named.
  function attachmentsEl(refs) {
    const box = document.createElement("div");
    box.className = "attachments";
    for (const a of refs) {
      const name = a.name || "file";
      if (!a.id) {
        const s = document.createElement("span"); s.className = "unread";
        s.textContent = "📎 " + name + (a.note ? " (not read: " + a.note + ")" : ""); box.appendChild(s); continue;
      }
      const url = "/api/sessions/" + encodeURIComponent(app.session) + "/attachments/" + encodeURIComponent(a.id);
      const link = document.createElement("a"); link.href = url;
      if (a.kind === "image" && /^image\/(png|jpeg|gif|webp)$/.test(a.content_type || "")) {
        link.target = "_blank"; link.rel = "noopener";
        const img = document.createElement("img"); img.className = "preview"; img.src = url; img.alt = name; img.loading = "lazy";
        img.addEventListener("error", () => { link.replaceChildren(document.createTextNode("🖼 " + name + " (no longer available)")); }, { once: true });
        link.appendChild(img);
      } else {
        link.className = "file"; link.download = name; link.textContent = "📎 " + name + (a.size != null ? " (" + sizeText(a.size) + ")" : "");
      }
      box.appendChild(link);
    }
    return box;
  }
  function sizeText(n) { return n < 1000 ? n + " bytes" : n < 1e6 ? Math.round(n / 1000) + " KB" : (n / 1e6).toFixed(1) + " MB"; }
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

  // The top of the conversation: a way to older messages while there are any.
  function renderTop() {
    const top = $("older");
    if (!top) return;
    top.hidden = !app.mirror.hasMore;
    top.disabled = app.loadingOlder;
    top.textContent = app.loadingOlder ? "Loading earlier messages…" : "Load earlier messages";
  }

  // Rebuilds the conversation from cached elements (each stored message is rendered once). keepPosition:
  // older messages were added above, so the part being read stays in place.
  function renderHistory(opts) {
    const box = $("messages");
    const stick = nearBottom();
    const fromBottom = box.scrollHeight - box.scrollTop;
    const top = box.scrollTop;
    const frag = document.createDocumentFragment();
    const older = document.createElement("button");
    older.type = "button"; older.id = "older";
    older.addEventListener("click", () => loadOlder());
    frag.appendChild(older);
    const byAfter = new Map();
    for (const n of app.notices) { if (!byAfter.has(n.after)) byAfter.set(n.after, []); byAfter.get(n.after).push(n); }
    for (const n of byAfter.get(null) || []) frag.appendChild(noticeEl(n.text));
    const toolNames = new Map();
    const rendered = new Map();
    for (const m of app.mirror.messages) {
      if (m.role === "assistant") for (const c of m.tool_calls || []) toolNames.set(c.id, c.name);
      // an assistant message with neither text nor calls (an answer without a word) shows as its notice alone
      const wordless = m.role === "assistant" && m.kind !== "notice" && !m.content && !(m.tool_calls || []).length;
      if (!wordless && (m.role === "user" || m.role === "assistant" || m.role === "tool")) {
        const name = m.role === "tool" ? toolNames.get(m.tool_call_id) || "" : "";
        const key = m.id + "\u0000" + name;
        const el = app.rendered.get(key) || messageEl(m, name);
        rendered.set(key, el);
        frag.appendChild(el);
      }
      for (const n of byAfter.get(m.id) || []) frag.appendChild(noticeEl(n.text));
    }
    app.rendered = rendered;
    for (const [cid, p] of app.pending) if (p.session === app.session && !p.command) frag.appendChild(pendingEl(cid, p));
    let liveBox = $("live"); // kept (with the live reply in it) across rebuilds
    if (!liveBox) { liveBox = document.createElement("div"); liveBox.id = "live"; }
    frag.appendChild(liveBox);
    box.replaceChildren(frag);
    renderTop();
    renderSessions();
    renderLive();
    if (opts && opts.keepPosition) box.scrollTop = box.scrollHeight - fromBottom;
    else if (stick) scrollDown(true);
    else box.scrollTop = top;
    maybeLoadOlder(); // a first page shorter than the screen cannot be scrolled: fetch more now
  }

  // A live reply is re-rendered as its events arrive, but never more often than its last render cost allows
  // (at most a fifth of the time goes to rendering), so a long reply with much code cannot freeze the page.
  let liveTimer = null;
  let liveDoneAt = 0;
  let liveCost = 0;
  function scheduleLive() {
    if (liveTimer !== null) return;
    const wait = Math.max(0, liveDoneAt + Math.min(liveCost * 4, 1000) - performance.now());
    liveTimer = setTimeout(() => { liveTimer = null; renderLive(); }, wait);
  }

  // The live reply keeps one element per turn: its text is updated block by block (fillMarkdown), its tool
  // lines, approvals and error are rebuilt (they are short).
  function renderLive() {
    if (liveTimer !== null) { clearTimeout(liveTimer); liveTimer = null; }
    const started = performance.now();
    const stick = nearBottom();
    const holder = $("live");
    if (!holder) return;
    const live = app.live;
    const running = !!(live && live.state === "running");
    $("stop").hidden = !running || live.committed;
    if (!live || live.committed) {
      holder.textContent = "";
      app.liveView = null;
    } else {
      let view = app.liveView;
      if (!view || view.turnId !== live.turn_id || !holder.contains(view.div)) {
        const div = document.createElement("div");
        const body = document.createElement("div");
        body.className = "body";
        const extra = document.createElement("div");
        div.append(body, extra);
        view = app.liveView = { turnId: live.turn_id, div, body, extra };
        holder.replaceChildren(div);
      }
      view.div.className = "msg assistant live" + (running ? " typing" : "");
      view.div.dataset.turn = live.turn_id;
      fillMarkdown(view.body, live.text);
      const parts = [];
      if (live.tools && live.tools.length) {
        const ul = document.createElement("ul"); ul.className = "tools";
        for (const t of live.tools) { const li = document.createElement("li"); li.className = t.status; li.textContent = t.name + " — " + t.status.replace("_", " ") + (t.summary ? ": " + t.summary : ""); ul.appendChild(li); }
        parts.push(ul);
      }
      const children = [...(live.children || new Map()).values()];
      const own = [];
      const byChild = new Map();
      for (const a of (running && live.approvals) || []) {
        const k = childKey(a.origin);
        if (a.origin && a.origin.length && (live.children || new Map()).has(k)) { if (!byChild.has(k)) byChild.set(k, []); byChild.get(k).push(a); } else own.push(a);
      }
      if (children.length) {
        const box = document.createElement("div"); box.className = "subagents";
        for (const c of children) box.appendChild(cardEl(c, byChild.get(childKey(c.origin)), running));
        parts.push(box);
      }
      for (const a of own) parts.push(approvalEl(a));
      if (live.error) { const e = document.createElement("div"); e.className = "turn-error"; e.textContent = live.error; parts.push(e); }
      view.extra.replaceChildren(...parts);
    }
    scrollDown(stick);
    liveDoneAt = performance.now();
    liveCost = liveDoneAt - started;
    stats.liveRenders++;
    stats.liveRenderMs += liveCost;
    stats.liveRenderMaxMs = Math.max(stats.liveRenderMaxMs, liveCost);
  }

  // approvals: Allow / Deny under the live turn; a click disables both until the turn events move on
  function approvalEl(a) {
    const box = document.createElement("div");
    box.className = "approval";
    box.dataset.callId = a.call_id;
    const q = document.createElement("div"); q.className = "q";
    const name = document.createElement("strong"); name.textContent = a.tool_name;
    q.append("Run ", name, "?");
    if (a.label) { const who = document.createElement("span"); who.className = "asker"; who.textContent = " (asked by subagent " + a.label + ")"; q.append(who); }
    box.appendChild(q);
    if (a.arguments) { const args = document.createElement("code"); args.className = "args"; args.textContent = a.arguments; box.appendChild(args); }
    const chosen = app.decisions.get(approvalKey(a));
    const row = document.createElement("div"); row.className = "buttons";
    for (const [decision, label] of [["allow", "Allow"], ["deny", "Deny"]]) {
      const b = document.createElement("button");
      b.type = "button"; b.className = decision; b.textContent = label; b.disabled = !!chosen;
      b.addEventListener("click", () => decide(a, decision));
      row.appendChild(b);
    }
    if (chosen) { const s = document.createElement("span"); s.className = "chosen"; s.textContent = chosen === "allow" ? "Allowing…" : "Denying…"; row.appendChild(s); }
    box.appendChild(row);
    return box;
  }
  async function decide(a, decision) {
    const key = approvalKey(a);
    if (!app.session || app.decisions.has(key)) return;
    const sid = app.session;
    app.decisions.set(key, decision);
    renderLive();
    // a subagent's call is decided here, in its parent's conversation, naming whose call it is
    const body = a.origin && a.origin.length ? { decision, origin: a.origin } : { decision };
    const path = "/api/sessions/" + sid + "/approvals/" + encodeURIComponent(a.call_id);
    // A decision whose answer was lost (network error, 5xx) is sent again; its 404 then most likely means
    // the first one was recorded, and the buttons stay disabled until the turn's events move on.
    for (let attempt = 0; ; attempt++) {
      const r = await postDecision(path, body);
      if (r.ok || app.session !== sid) return;
      if (r.retry && attempt < DECIDE_RETRY_DELAYS.length) { await sleep(DECIDE_RETRY_DELAYS[attempt]); continue; }
      if (r.status === 404 && attempt > 0) return;
      app.decisions.delete(key);
      addNotice("⚠️ The " + decision + " was not recorded: " + r.error);
      return;
    }
  }
  const DECIDE_RETRY_DELAYS = [500, 1000, 2000];
  async function postDecision(path, body) {
    try {
      await api("POST", path, body);
      return { ok: true };
    } catch (e) {
      const status = e.status || 0;
      return { error: e.message, status, retry: status === 0 || status >= 500 };
    }
  }

  // attaching: each file is uploaded at once (the server checks the caps); the next message carries them
  let outgoingKeys = 0;
  function attach(files) {
    if (!app.session) return;
    for (const file of files) {
      const item = { key: ++outgoingKeys, name: file.name, ref: null, session: app.session };
      app.outgoing.push(item);
      upload(item, file);
    }
    renderOutgoing();
  }
  async function upload(item, file) {
    const form = new FormData();
    form.append("file", file, file.name);
    try {
      const resp = await fetch("/api/sessions/" + item.session + "/attachments", { method: "POST", body: form, credentials: "same-origin" });
      let data = null;
      try { data = await resp.json(); } catch (_) { data = null; }
      if (!resp.ok) throw new Error((data && data.error) || ("HTTP " + resp.status));
      item.ref = data;
    } catch (e) {
      app.outgoing = app.outgoing.filter((o) => o !== item);
      addNotice("⚠️ Not attached: " + item.name + ": " + e.message);
    }
    renderOutgoing();
  }
  function renderOutgoing() {
    const box = $("outgoing");
    const items = app.outgoing.filter((o) => o.session === app.session);
    box.hidden = !items.length;
    box.replaceChildren(...items.map((o) => {
      const chip = document.createElement("span"); chip.className = "chip" + (o.ref ? "" : " uploading");
      chip.textContent = "📎 " + o.name + (o.ref ? "" : " …");
      const remove = document.createElement("button"); remove.type = "button"; remove.textContent = "×"; remove.title = "Remove";
      remove.addEventListener("click", () => { app.outgoing = app.outgoing.filter((x) => x !== o); renderOutgoing(); });
      chip.appendChild(remove);
      return chip;
    }));
  }

  // sending: a message keeps its client_id until the server has it. A POST whose answer is lost (network
  // error, 5xx, 503 while the bridge restarts) is sent again with the SAME client_id (the server answers
  // "duplicate" when the first one was stored), a bounded number of times; then the message stays on the
  // page as "not sent" with Resend (same client_id) and Edit (text and files back into the composer). A
  // "busy" answer, a /new that dropped it: "not queued", with the same two buttons.
  const SEND_RETRY_DELAYS = [500, 1000, 2000, 4000, 8000]; // ms before each new attempt (about 15 s in all)
  const SEND_GIVE_UP_MS = 30000;                           // no new attempt after this long
  app.sendRetryDelays = SEND_RETRY_DELAYS;                 // the tests shorten them
  const ACCEPTED = new Set(["queued", "duplicate", "command"]);

  async function send(text) {
    const files = app.outgoing.filter((o) => o.session === app.session);
    if (!app.session || (!text.trim() && !files.length)) return;
    if (files.some((o) => !o.ref)) { addNotice("⏳ Wait until the attachments are uploaded."); $("input").value = text; return; }
    app.outgoing = app.outgoing.filter((o) => o.session !== app.session);
    renderOutgoing();
    const entry = { session: app.session, text, files: files.map((o) => o.ref), state: "sending", note: "",
                    command: text.trim().startsWith("/"), afterSeq: newestSeq(), notice: null };
    const cid = newClientId();
    app.pending.set(cid, entry);
    renderHistory(); scrollDown(true);
    await deliver(cid, entry);
  }
  function newestSeq() {
    const msgs = app.mirror.messages;
    return msgs.length && typeof msgs[msgs.length - 1].seq === "number" ? msgs[msgs.length - 1].seq : -1;
  }

  // One POST of a message: {status} when the server answered it, {error, retry} when not.
  async function postMessage(cid, entry) {
    const body = { text: entry.text, client_id: cid, attachments: entry.files.map((r) => r.id) };
    app.sentIds.add(cid);
    let resp;
    try {
      resp = await fetch("/api/sessions/" + entry.session + "/messages", {
        method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    } catch (e) {
      return { error: "the connection failed", retry: true }; // it may have been stored: the retry tells
    }
    if (resp.status === 401) { location.href = "/login"; return { error: "authentication required", retry: false }; }
    let data = null;
    try { data = await resp.json(); } catch (_) { data = null; }
    if (resp.ok && data && ACCEPTED.has(data.status)) return { status: data.status };
    if (resp.ok && data && data.status === "busy") return { status: "busy" };
    return { error: (data && data.error) || ("HTTP " + resp.status), retry: resp.status >= 500 };
  }

  async function deliver(cid, entry) {
    const started = Date.now();
    entry.state = "sending"; entry.note = "";
    for (let attempt = 0; ; attempt++) {
      const r = await postMessage(cid, entry);
      if (app.pending.get(cid) !== entry) return; // answered (or discarded) meanwhile
      if (r.status === "busy") return markUnsent(cid, entry, entry.notice || "⏳ The bridge is still working on your earlier messages; this one was not queued.");
      if (r.status) return accepted(cid, entry, r.status);
      const delays = app.sendRetryDelays;
      if (!r.retry || attempt >= delays.length || Date.now() - started > SEND_GIVE_UP_MS) return markUnsent(cid, entry, "⚠️ Not sent: " + r.error);
      entry.note = "Not sent yet (" + r.error + "); trying again…";
      renderPending();
      await sleep(delays[attempt]);
      if (app.pending.get(cid) !== entry) return;
    }
  }
  function sleep(ms) { return new Promise((resolve) => setTimeout(resolve, ms)); }

  function accepted(cid, entry, status) {
    const notice = entry.notice;
    entry.notice = null;
    if (status === "command") app.pending.delete(cid);
    else { entry.state = "queued"; entry.note = ""; entry.command = false; }
    if (notice) addNotice(notice); else renderPending(); // a notice that came before the answer (not "busy")
  }
  function markUnsent(cid, entry, note) {
    entry.state = "unsent"; entry.note = note; entry.notice = null; entry.command = false;
    renderPending();
  }
  // Resend keeps the client_id (the server then answers "duplicate" if an earlier try was stored after all),
  // except for a message /new dropped: that one was stored and is not answered, so it goes as a new one.
  function resend(cid) {
    const entry = app.pending.get(cid);
    if (!entry || entry.state !== "unsent") return;
    if (entry.dropped) {
      app.pending.delete(cid);
      cid = newClientId();
      entry.dropped = false;
      entry.afterSeq = newestSeq();
      app.pending.set(cid, entry);
    }
    deliver(cid, entry);
    renderPending();
  }
  // Edit: the message goes back into the composer (its files too) and leaves the conversation.
  function editUnsent(cid) {
    const entry = app.pending.get(cid);
    if (!entry || entry.state !== "unsent") return;
    app.pending.delete(cid);
    const input = $("input");
    input.value = entry.text + (input.value ? "\n" + input.value : "");
    for (const ref of entry.files) app.outgoing.push({ key: ++outgoingKeys, name: ref.name, ref, session: entry.session });
    renderOutgoing();
    renderHistory();
    input.focus();
  }
  // A notice about one of this page's messages. "busy" (and a /new that dropped messages) turn the message
  // into "not queued" showing the notice once, in place; a notice that comes before the POST's answer waits
  // for it (only then is it known to be the "busy" one). A notice for the sender only (a busy notice, a command's
  // answer) of a message another tab sent is not this page's business: the stream carries it to every tab.
  function messageNotice(d) {
    for (const dropped of d.dropped || []) {
      const e = app.pending.get(dropped);
      if (e && !e.command) { markUnsent(dropped, e, "⚠️ Not answered: /new started a new conversation."); e.dropped = true; }
    }
    if (d.sender_only && !app.sentIds.has(d.client_id)) return;
    const entry = d.client_id ? app.pending.get(d.client_id) : undefined;
    if (entry && entry.state === "sending") { entry.notice = d.text; return; }
    if (entry && entry.state === "unsent") { if (!(d.dropped || []).length) { entry.note = d.text; renderPending(); } return; }
    if (entry) app.pending.delete(d.client_id);
    addNotice(d.text);
  }
  function pendingEl(cid, p) {
    const d = document.createElement("div");
    d.className = "msg user " + (p.state === "unsent" ? "unsent" : "pending");
    d.dataset.clientId = cid;
    const text = document.createElement("div"); text.className = "text"; text.textContent = p.text;
    d.appendChild(text);
    if (p.files.length) d.appendChild(attachmentsEl(p.files));
    if (p.note) { const n = document.createElement("div"); n.className = "send-note"; n.textContent = p.note; d.appendChild(n); }
    if (p.state === "unsent") {
      const row = document.createElement("div"); row.className = "buttons";
      for (const [cls, label, fn] of [["resend", "Resend", resend], ["edit", "Edit", editUnsent]]) {
        const b = document.createElement("button"); b.type = "button"; b.className = cls; b.textContent = label;
        b.addEventListener("click", () => fn(cid));
        row.appendChild(b);
      }
      d.appendChild(row);
    }
    return d;
  }
  function renderPending() { renderHistory(); }

  function openSession(id) {
    app.session = id;
    history.replaceState(null, "", "#" + id);
    // a message not yet in history stays in app.pending: each shows in its own conversation
    app.live = null; app.notices = []; app.held = []; app.decisions.clear(); app.cardOpen.clear();
    app.refetch = false;
    app.rendered = new Map(); app.loadingOlder = false;
    app.mirror.loadFull(id, null, [], false);
    app.mirror.revision = null;
    renderHistory();
    renderOutgoing();
    connect(id);
    return fullFetch();
  }

  async function start() {
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); const t = $("input").value; $("input").value = ""; send(t); });
    $("input").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); } });
    $("stop").addEventListener("click", () => { if (app.session) api("POST", "/api/sessions/" + app.session + "/stop").catch((e) => setStatus(e.message)); });
    $("new-chat").addEventListener("click", () => newSession().catch((e) => setStatus(e.message)));
    $("rename").addEventListener("click", startRename);
    $("toggle-sidebar").addEventListener("click", () => $("app").classList.toggle("show-sidebar"));
    $("messages").addEventListener("scroll", maybeLoadOlder, { passive: true });
    $("files").addEventListener("change", (e) => { attach(Array.from(e.target.files || [])); e.target.value = ""; });
    const chat = $("chat");
    const dragging = (e) => e.dataTransfer && Array.from(e.dataTransfer.types || []).includes("Files");
    chat.addEventListener("dragover", (e) => { if (dragging(e)) { e.preventDefault(); chat.classList.add("dropping"); } });
    chat.addEventListener("dragleave", (e) => { if (e.target === chat || !chat.contains(e.relatedTarget)) chat.classList.remove("dropping"); });
    chat.addEventListener("drop", (e) => { if (!dragging(e)) return; e.preventDefault(); chat.classList.remove("dropping"); attach(Array.from(e.dataTransfer.files || [])); });
    try {
      await loadSessions();
      const wanted = location.hash.slice(1);
      if (wanted && /^[A-Za-z0-9_-]{1,64}$/.test(wanted)) {
        if (!app.sessions.find((s) => s.id === wanted)) app.sessions.unshift({ id: wanted, title: "New chat" });
        await openSession(wanted);
      } else if (app.sessions.length) await openSession(app.sessions[0].id);
      else await newSession();
      document.body.dataset.ready = "1";
    } catch (e) { setStatus(e.message); }
  }

  window.chatbridge = { renderMarkdown, HistoryMirror, app, openSession, fullFetch, loadOlder };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
})();
