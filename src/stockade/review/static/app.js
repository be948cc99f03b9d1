// stockade review page: hand-written, no framework, no network but this page's own server.
// Every piece of file content is untrusted (a sandbox wrote it): it only ever reaches the
// page as text nodes (textContent, createTextNode), never as HTML.
"use strict";

(function () {
  const TOKEN = new URLSearchParams(location.search).get("token") || "";
  const POLL_MS = 1500;

  let state = null;          // /api/state
  let current = null;        // /api/file of the file shown
  let split = false;         // side by side (else unified)
  const decisions = {};      // path -> {decision: "approve"|"reject", hunks?: {index: bool}, content?: string}
  const changedSince = new Set(); // paths whose decision was dropped because they changed
  let polling = false;

  const $ = (id) => document.getElementById(id);
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function show(node, on) { node.classList.toggle("hidden", !on); }

  // ------------------------------------------------------------------ requests
  // a file name that is not UTF-8 reaches the page with lone surrogates, which a URL
  // cannot carry: then as a JSON string (its escapes are ASCII)
  function pathQuery(path) {
    try { return "path=" + encodeURIComponent(path); }
    catch (e) { return "pathj=" + encodeURIComponent(JSON.stringify(path)); }
  }
  async function get(path) {
    const sep = path.includes("?") ? "&" : "?";
    const r = await fetch(path + sep + "token=" + encodeURIComponent(TOKEN), { cache: "no-store" });
    const body = await r.json().catch(() => ({ error: "unreadable answer (" + r.status + ")" }));
    if (!r.ok) throw Object.assign(new Error(body.error || r.statusText), { status: r.status, body });
    return body;
  }
  async function post(path, payload) {
    const r = await fetch(path, {
      method: "POST", cache: "no-store",
      headers: { "Content-Type": "application/json", "X-Stockade-Token": TOKEN },
      body: JSON.stringify(payload),
    });
    const body = await r.json().catch(() => ({ error: "unreadable answer (" + r.status + ")" }));
    if (!r.ok) throw Object.assign(new Error(body.error || r.statusText), { status: r.status, body });
    return body;
  }
  function error(msg, extra) {
    const box = $("error");
    box.textContent = "";
    if (msg) {
      box.appendChild(el("span", null, msg));
      if (extra) box.appendChild(extra);
    }
    show(box, !!msg);
  }
  function banner(msg, extra) {
    const box = $("banner");
    box.textContent = msg || "";
    if (extra) box.appendChild(extra);
    show(box, !!msg);
  }

  // ------------------------------------------------------------------ syntax colouring
  const LANGS = {
    py: { kw: "False None True and as assert async await break class continue def del elif else except finally for from global if import in is lambda nonlocal not or pass raise return try while with yield match case self", line: ["#"], str: ["\"\"\"", "'''", "\"", "'"] },
    js: { kw: "break case catch class const continue debugger default delete do else export extends false finally for function if import in instanceof let new null return super switch this throw true try typeof undefined var void while with yield async await of static interface type enum implements private public protected readonly", line: ["//"], block: true, str: ["\"", "'", "`"] },
    c: { kw: "auto break case char const continue default do double else enum extern float for goto if inline int long register restrict return short signed sizeof static struct switch typedef union unsigned void volatile while bool true false NULL class namespace template typename public private protected virtual override nullptr new delete using include define ifdef ifndef endif pragma", line: ["//"], block: true, str: ["\"", "'"] },
    go: { kw: "break case chan const continue default defer else fallthrough for func go goto if import interface map package range return select struct switch type var nil true false", line: ["//"], block: true, str: ["\"", "'", "`"] },
    rs: { kw: "as async await break const continue crate dyn else enum extern false fn for if impl in let loop match mod move mut pub ref return self Self static struct super trait true type unsafe use where while", line: ["//"], block: true, str: ["\""] },
    java: { kw: "abstract boolean break byte case catch char class const continue default do double else enum extends final finally float for if implements import instanceof int interface long new null package private protected public return short static super switch this throw throws try void volatile while true false var", line: ["//"], block: true, str: ["\"", "'"] },
    rb: { kw: "BEGIN END alias and begin break case class def defined? do else elsif end ensure false for if in module next nil not or redo rescue retry return self super then true undef unless until when while yield require", line: ["#"], str: ["\"", "'"] },
    sh: { kw: "if then else elif fi case esac for while until do done in function return local export readonly set unset shift exit echo printf cd test", line: ["#"], str: ["\"", "'"] },
    conf: { kw: "true false null yes no on off", line: ["#"], str: ["\"", "'"] },
    json: { kw: "true false null", line: [], str: ["\""] },
    css: { kw: "important media import from to", line: [], block: true, str: ["\"", "'"] },
  };
  const EXT = {
    py: "py", pyi: "py", js: "js", mjs: "js", cjs: "js", ts: "js", tsx: "js", jsx: "js",
    c: "c", h: "c", cc: "c", cpp: "c", hpp: "c", cxx: "c", go: "go", rs: "rs", java: "java", kt: "java",
    rb: "rb", sh: "sh", bash: "sh", zsh: "sh", yml: "conf", yaml: "conf", toml: "conf", ini: "conf",
    cfg: "conf", json: "json", css: "css",
  };
  const KWSETS = {};
  function langOf(path) {
    const base = path.split("/").pop();
    if (base === "Makefile" || base === "Dockerfile") return "sh";
    const m = /\.([A-Za-z0-9]+)$/.exec(base);
    return m ? EXT[m[1].toLowerCase()] || null : null;
  }
  // one line into [class|null, text] tokens: comments, strings, numbers, keywords
  function tokens(line, lang) {
    const L = LANGS[lang];
    if (!L) return [[null, line]];
    if (!KWSETS[lang]) KWSETS[lang] = new Set(L.kw.split(" "));
    const kws = KWSETS[lang];
    const out = [];
    let plain = "";
    const flush = () => { if (plain) { out.push([null, plain]); plain = ""; } };
    let i = 0;
    while (i < line.length) {
      const rest = line.slice(i);
      if (L.line.some((c) => rest.startsWith(c))) { flush(); out.push(["tk-com", rest]); return out; }
      if (L.block && rest.startsWith("/*")) {
        const end = rest.indexOf("*/", 2);
        const n = end < 0 ? rest.length : end + 2;
        flush(); out.push(["tk-com", rest.slice(0, n)]); i += n; continue;
      }
      const q = L.str.find((s) => rest.startsWith(s));
      if (q) {
        let j = q.length;
        while (j < rest.length && !rest.startsWith(q, j)) j += rest[j] === "\\" ? 2 : 1;
        const n = Math.min(rest.length, j + q.length);
        flush(); out.push(["tk-str", rest.slice(0, n)]); i += n; continue;
      }
      const num = /^\d[\dA-Fa-fxX_.]*/.exec(rest);
      if (num && !/[A-Za-z0-9_$]/.test(plain.slice(-1))) { flush(); out.push(["tk-num", num[0]]); i += num[0].length; continue; }
      const word = /^[A-Za-z_$][\w$?]*/.exec(rest);
      if (word) {
        if (kws.has(word[0])) { flush(); out.push(["tk-kw", word[0]]); } else plain += word[0];
        i += word[0].length; continue;
      }
      plain += line[i]; i += 1;
    }
    flush();
    return out;
  }
  function codeCell(td, text, lang) {
    const line = text.replace(/\r?\n$/, "");
    for (const [cls, t] of tokens(line, lang)) {
      if (cls) td.appendChild(el("span", cls, t)); else td.appendChild(document.createTextNode(t));
    }
    if (!line) td.appendChild(document.createTextNode(" "));
    if (!text.endsWith("\n") && text.length) td.appendChild(el("span", "tk-com", "  ⏎ no newline at end"));
  }

  // ------------------------------------------------------------------ decisions
  function decisionOf(path) { return decisions[path] || null; }
  function decide(path, what) {
    if (what === null) delete decisions[path];
    else decisions[path] = { decision: what };
    changedSince.delete(path);
    renderTree(); renderFileHead(); renderDiff(); renderSummary();
  }
  function setHunk(path, index, take) {
    const count = current && current.path === path ? current.hunks.length : 0;
    let d = decisions[path];
    if (!d || d.decision !== "approve" || !d.hunks) {
      // the first hunk decided: every other hunk starts as taken (or none, when the file was rejected)
      const start = !(d && d.decision === "reject");
      d = { decision: "approve", hunks: {} };
      for (let k = 0; k < count; k++) d.hunks[k] = start;
    }
    d.hunks[index] = take;
    decisions[path] = d;
    changedSince.delete(path);
    renderTree(); renderFileHead(); renderDiff(); renderSummary();
  }
  function payloadOf(path) {
    const d = decisions[path];
    if (d.content !== undefined) return { decision: "approve", content: d.content };
    if (d.decision === "approve" && d.hunks) {
      const taken = Object.keys(d.hunks).filter((k) => d.hunks[k]).map(Number).sort((a, b) => a - b);
      return { decision: "approve", hunks: taken };
    }
    return { decision: d.decision };
  }
  function partialMark(d) {
    if (!d) return null;
    if (d.content !== undefined) return ["edited", "edited"];
    if (d.hunks) {
      const all = Object.keys(d.hunks).length;
      const taken = Object.values(d.hunks).filter(Boolean).length;
      if (taken === 0) return ["partial", "no hunk taken"];
      if (taken < all) return ["partial", taken + "/" + all + " hunks"];
    }
    return null;
  }

  // ------------------------------------------------------------------ rendering
  function entries() { return state ? state.changes.filter((c) => !(c.is_dir && c.has_children)) : []; }

  function renderHeader() {
    $("session-name").textContent = "session " + state.session;
    $("project").textContent = state.project;
    $("live").textContent = state.living ? "● living sandbox: refreshing as it writes" : "";
    $("live").classList.toggle("on", state.living);
    $("counts").textContent = state.changes.length ? state.counts.phrase : "";
    const risks = $("risks");
    risks.textContent = "";
    if (!state.risks.length) {
      risks.appendChild(el("span", "muted", "Risk summary: nothing flagged."));
    } else {
      risks.appendChild(el("strong", null, "Deserves a second look:"));
      const ul = el("ul");
      for (const r of state.risks) {
        const li = el("li", r.severity || "");
        li.textContent = (r.severity ? "[" + r.severity + "] " : "") + (r.rule ? r.rule + ": " : "") +
          r.reason + (r.paths && r.paths.length ? " — " + r.paths.slice(0, 8).join(", ") + (r.paths.length > 8 ? ", …" : "") : "");
        ul.appendChild(li);
      }
      risks.appendChild(ul);
    }
  }

  function renderTree() {
    const tree = $("tree");
    tree.textContent = "";
    if (!state.changes.length) {
      tree.appendChild(el("li", "muted", state.living
        ? "No changes yet: this page shows them as the sandbox writes."
        : "No changes in this session."));
      return;
    }
    const shownDirs = new Set();
    for (const c of entries()) {
      const parts = c.path.split("/");
      for (let i = 1; i < parts.length; i++) {
        const d = parts.slice(0, i).join("/");
        if (shownDirs.has(d)) continue;
        shownDirs.add(d);
        const li = el("li", "dir");
        li.appendChild(el("span", "dirname", "  ".repeat(i - 1) + parts[i - 1] + "/"));
        tree.appendChild(li);
      }
      const li = el("li", "file");
      li.dataset.path = c.path;
      if (current && current.path === c.path) li.classList.add("current");
      if (changedSince.has(c.path)) li.classList.add("changed-since");
      li.appendChild(el("span", "st st-" + c.status, c.status));
      const name = el("span", "name", "  ".repeat(parts.length - 1) + parts[parts.length - 1] + (c.is_dir ? "/" : ""));
      name.title = c.path;
      name.addEventListener("click", () => openFile(c.path));
      li.appendChild(name);
      for (const m of c.marks) if (!["added", "modified", "deleted", "dir"].includes(m)) li.appendChild(el("span", "mark", m));
      if (c.held_back) { const h = el("span", "mark held", "held back"); h.title = c.held_back; li.appendChild(h); }
      const pm = partialMark(decisionOf(c.path));
      if (pm) li.appendChild(el("span", "mark " + pm[0], pm[1]));
      const d = decisionOf(c.path);
      const ok = el("button", "approve" + (d && d.decision === "approve" ? " on" : ""), "✓");
      ok.type = "button"; ok.title = "approve"; ok.disabled = c.kind === "refused";
      ok.addEventListener("click", () => decide(c.path, d && d.decision === "approve" && !d.hunks && d.content === undefined ? null : "approve"));
      const no = el("button", "reject" + (d && d.decision === "reject" ? " on" : ""), "✗");
      no.type = "button"; no.title = "reject (discard from the session)";
      no.addEventListener("click", () => decide(c.path, d && d.decision === "reject" ? null : "reject"));
      li.appendChild(ok); li.appendChild(no);
      tree.appendChild(li);
    }
    renderHeld();
  }

  function renderHeld() {
    const box = $("held");
    box.textContent = "";
    const held = state.changes.filter((c) => c.held_back || c.reason);
    if (!held.length) return;
    box.appendChild(el("h3", null, "Held back (applied only when you approve them one by one)"));
    const ul = el("ul");
    for (const c of held) ul.appendChild(el("li", null, c.path + ": " + (c.held_back || c.reason)));
    box.appendChild(ul);
  }

  function renderSummary() {
    const ds = Object.keys(decisions).filter((p) => state.changes.some((c) => c.path === p));
    const a = ds.filter((p) => decisions[p].decision === "approve").length;
    const r = ds.length - a;
    $("summary").textContent = ds.length ? a + " to apply, " + r + " to discard, " +
      (entries().length - ds.length) + " left for later" : "Nothing decided yet.";
    $("apply").disabled = !ds.length;
  }

  function renderRuns() {
    const box = $("runs");
    box.textContent = "";
    box.appendChild(el("h3", null, "Runs that made these changes"));
    if (!state.runs.length) { box.appendChild(el("div", "muted", "No runs recorded.")); return; }
    const t = el("table");
    const head = el("tr");
    for (const h of ["#", "command", "exit", "outcome", "started", "time"]) head.appendChild(el("th", null, h));
    t.appendChild(head);
    for (const r of state.runs) {
      const tr = el("tr");
      tr.appendChild(el("td", null, r.run));
      tr.appendChild(el("td", "cmd", (r.kind && r.kind !== "run" ? "[" + r.kind + "] " : "") + (r.command || "")));
      const ex = el("td", r.exit === 0 ? "exit-ok" : (r.exit === null || r.exit === undefined ? "" : "exit-bad"),
        r.exit === null || r.exit === undefined ? (r.status || "") : r.exit);
      tr.appendChild(ex);
      tr.appendChild(el("td", null, r.outcome || ""));
      tr.appendChild(el("td", null, r.started || ""));
      tr.appendChild(el("td", null, r.duration !== null && r.duration !== undefined ? r.duration + " s" : ""));
      t.appendChild(tr);
    }
    box.appendChild(t);
  }

  function renderApplies() {
    const box = $("applies");
    box.textContent = "";
    if (!state.applies.length) return;
    box.appendChild(el("h3", null, "Applies of this session"));
    const t = el("table");
    for (const a of state.applies) {
      const tr = el("tr");
      tr.appendChild(el("td", null, a.id));
      tr.appendChild(el("td", null, a.state));
      tr.appendChild(el("td", null, a.paths.length + " path(s)"));
      const td = el("td");
      if (a.state === "done") {
        const b = el("button", "rollback", "Roll back");
        b.type = "button"; b.dataset.applyId = a.id;
        b.addEventListener("click", () => doRollback(a.id));
        td.appendChild(b);
      }
      tr.appendChild(td);
      t.appendChild(tr);
    }
    box.appendChild(t);
  }

  function renderFileHead() {
    const has = !!current;
    $("file-path").textContent = has ? current.path : "Choose a file on the left.";
    const marks = $("file-marks");
    marks.textContent = "";
    if (has) {
      for (const m of current.marks) marks.appendChild(el("span", "mark", m));
      if (current.old_mode && current.new_mode && current.old_mode !== current.new_mode)
        marks.appendChild(el("span", "mark", "mode " + current.old_mode + " → " + current.new_mode));
      const pm = partialMark(decisionOf(current.path));
      if (pm) marks.appendChild(el("span", "mark " + pm[0], pm[1]));
    }
    const d = has ? decisionOf(current.path) : null;
    $("file-approve").disabled = !has || current.kind === "refused";
    $("file-reject").disabled = !has;
    $("file-approve").classList.toggle("on", !!(d && d.decision === "approve" && !d.hunks && d.content === undefined));
    $("file-reject").classList.toggle("on", !!(d && d.decision === "reject"));
    $("edit").disabled = !(has && current.editable);
    $("view-toggle").textContent = split ? "Unified" : "Side by side";
  }

  function note(text) { return el("div", "note", text); }

  function renderDiff() {
    const box = $("diff");
    box.textContent = "";
    if (!current) return;
    const lang = langOf(current.path);
    if (current.kind === "refused") { box.appendChild(note("Not applicable: " + (current.marks.join(", ")) + ". Reject it to drop it from the session.")); return; }
    if (current.old_link !== null || current.new_link !== null) {
      box.appendChild(note("Symlink: " + (current.old_link !== null ? current.old_link : "(none)") + " → " +
        (current.new_link !== null ? current.new_link : "(none)")));
    }
    if (current.too_large) { box.appendChild(note("Too large to show here: approve or reject it whole.")); return; }
    if (current.binary) { box.appendChild(note("Binary file: approve or reject it whole.")); return; }
    const d = decisionOf(current.path);
    if (d && d.content !== undefined) {
      box.appendChild(note("You edited this file's new content: your text is what will be applied (Edit to change it, or drop your edit)."));
    }
    if (!current.hunks.length) {
      if (current.old_type === "dir" || current.new_type === "dir") box.appendChild(note("Directory (" + current.kind + ")."));
      else if (!(current.old_link !== null || current.new_link !== null)) box.appendChild(note("No content change" + (current.old_mode !== current.new_mode ? " (mode only)." : ".")));
      return;
    }
    for (const h of current.hunks) {
      const wrap = el("div", "hunk");
      wrap.dataset.index = h.index;
      let taken = null;
      if (d && d.decision === "reject") taken = false;
      else if (d && d.hunks) taken = !!d.hunks[h.index];
      else if (d && d.decision === "approve") taken = true;
      if (taken === true) wrap.classList.add("approved");
      if (taken === false) wrap.classList.add("rejected");
      const head = el("div", "hunk-head");
      head.appendChild(el("span", null, h.header));
      head.appendChild(el("span", "sp"));
      if (current.hunk_choice && !(d && d.content !== undefined)) {
        const ok = el("button", "hunk-approve", "Take hunk"); ok.type = "button";
        ok.addEventListener("click", () => setHunk(current.path, h.index, true));
        const no = el("button", "hunk-reject", "Reject hunk"); no.type = "button";
        no.addEventListener("click", () => setHunk(current.path, h.index, false));
        head.appendChild(ok); head.appendChild(no);
      }
      wrap.appendChild(head);
      wrap.appendChild(split ? sideBySide(h, lang) : unified(h, lang));
      box.appendChild(wrap);
    }
  }

  function unified(h, lang) {
    const t = el("table", "code");
    let o = h.old_start, n = h.new_start;
    for (const [tag, text] of h.lines) {
      const tr = el("tr", tag === "+" ? "add" : tag === "-" ? "del" : "ctx");
      tr.appendChild(el("td", "ln", tag === "+" ? "" : o));
      tr.appendChild(el("td", "ln", tag === "-" ? "" : n));
      tr.appendChild(el("td", "sg", tag));
      const td = el("td", "tx"); codeCell(td, text, lang); tr.appendChild(td);
      if (tag !== "+") o++;
      if (tag !== "-") n++;
      t.appendChild(tr);
    }
    return t;
  }

  function sideBySide(h, lang) {
    const t = el("table", "code");
    let o = h.old_start, n = h.new_start;
    const rows = [];
    let dels = [], adds = [];
    const flush = () => {
      for (let k = 0; k < Math.max(dels.length, adds.length); k++) rows.push([dels[k] || null, adds[k] || null]);
      dels = []; adds = [];
    };
    for (const [tag, text] of h.lines) {
      if (tag === "-") dels.push([o++, text]);
      else if (tag === "+") adds.push([n++, text]);
      else { flush(); rows.push([[o++, text, true], [n++, text, true]]); }
    }
    flush();
    for (const [l, r] of rows) {
      const tr = el("tr");
      for (const [side, cls] of [[l, "del"], [r, "add"]]) {
        if (!side) { tr.appendChild(el("td", "ln")); tr.appendChild(el("td", "tx empty")); continue; }
        const ctx = side[2] === true;
        tr.appendChild(el("td", "ln" + (ctx ? "" : " " + cls), side[0]));
        const td = el("td", "tx" + (ctx ? "" : " " + cls)); codeCell(td, side[1], lang); tr.appendChild(td);
      }
      t.appendChild(tr);
    }
    return t;
  }

  // ------------------------------------------------------------------ actions
  async function openFile(path) {
    try {
      current = await get("/api/file?" + pathQuery(path));
      error("");
    } catch (e) { error(e.message); current = null; }
    show($("editor-box"), false);
    renderTree(); renderFileHead(); renderDiff();
  }

  async function loadState(keepFile) {
    const before = state;
    state = await get("/api/state");
    if (before) {
      // a decision stands only on what the reviewer saw: drop those of paths that changed
      const sig = {};
      for (const c of before.changes) sig[c.path] = c.sig;
      for (const p of Object.keys(decisions)) {
        const now = state.changes.find((c) => c.path === p);
        if (!now) delete decisions[p];
        else if (now.sig !== sig[p]) { delete decisions[p]; changedSince.add(p); }
      }
    }
    renderHeader(); renderTree(); renderSummary(); renderRuns(); renderApplies();
    if (keepFile && current) {
      const now = state.changes.find((c) => c.path === current.path);
      if (!now) { current = null; renderFileHead(); renderDiff(); }
      else if (now.sig !== current.sig) await openFile(current.path);
    } else if (!current && entries().length) {
      await openFile(entries()[0].path);
    }
  }

  // every POLL_MS, or four times as long as the last look took (a large change set): the
  // server's work stays a small share of a core
  let pollEvery = POLL_MS;
  async function poll() {
    if (polling) return;  // one chain of timeouts: never two looks at once
    if (!state) { setTimeout(poll, pollEvery); return; }
    polling = true;
    const t0 = performance.now();
    try {
      const fp = await get("/api/fingerprint");
      pollEvery = Math.max(POLL_MS, 4 * (performance.now() - t0));
      if (fp.fingerprint !== state.fingerprint && $("follow").checked) {
        await loadState(true);
        banner("The change set changed (a sandbox wrote, or something was applied or discarded): the page shows it as it is now." +
          (changedSince.size ? " Decisions on changed files were cleared." : ""));
      } else if (fp.fingerprint !== state.fingerprint) {
        const again = el("button", null, "Show it");
        again.type = "button"; again.id = "reload";
        again.addEventListener("click", async () => { banner(""); await loadState(true); });
        banner("The change set changed since this page showed it: applying now would be refused. ", again);
      }
    } catch (e) { /* the server is gone or busy: the next poll says */ }
    polling = false;
    setTimeout(poll, pollEvery);
  }

  async function doApply(force) {
    const files = {};
    for (const p of Object.keys(decisions)) if (state.changes.some((c) => c.path === p)) files[p] = payloadOf(p);
    $("apply").disabled = true;
    try {
      const res = await post("/api/apply", { fingerprint: state.fingerprint, files, force: !!force });
      error(""); banner("");
      for (const p of Object.keys(files)) delete decisions[p];
      showResult(res);
      current = null;
      await loadState(false);
    } catch (e) {
      const b = e.body || {};
      if (b.kind === "stale") {
        error("Not applied: " + e.message + " The page now shows the change set as it is.");
        await loadState(true);
      } else if (b.kind === "conflict") {
        const again = el("button", null, "Apply anyway (overwrite the host's edits)");
        again.type = "button"; again.id = "force-apply";
        again.addEventListener("click", () => doApply(true));
        error("Not applied: " + e.message + " ", again);
      } else {
        error("Not applied: " + e.message);
      }
    }
    renderSummary();
  }

  function showResult(res) {
    const box = $("result");
    box.textContent = "";
    box.appendChild(el("h3", null, res.apply_id ? "Applied (apply " + res.apply_id + ")" : "Done"));
    if (res.applied.length) {
      box.appendChild(el("div", null, "Applied to the project:"));
      const ul = el("ul"); ul.id = "applied-list";
      for (const p of res.applied) ul.appendChild(el("li", null, p + (res.partial[p] ? " (hunk" + (res.partial[p].length > 1 ? "s " : " ") + res.partial[p].map((x) => x + 1).join(", ") + ")" : "") + (res.edited.includes(p) ? " (your edit)" : "")));
      box.appendChild(ul);
    }
    if (res.discarded.length) {
      box.appendChild(el("div", null, "Discarded from the session:"));
      const ul = el("ul"); ul.id = "discarded-list";
      for (const p of res.discarded) ul.appendChild(el("li", null, p));
      box.appendChild(ul);
    }
    if (res.discard_error) {
      const e = el("div", "exit-bad", res.discard_error + " (the rejected paths stay in the session)");
      e.id = "discard-error";
      box.appendChild(e);
    }
    if (res.apply && res.apply.held_back.length) {
      box.appendChild(el("div", null, "Held back: " + res.apply.held_back.join(", ")));
    }
    if (res.apply_id) {
      const b = el("button", null, "Roll back this apply"); b.type = "button"; b.id = "rollback";
      b.dataset.applyId = res.apply_id;
      b.addEventListener("click", () => doRollback(res.apply_id));
      box.appendChild(b);
      const id = el("span", "muted", " (or: stockade rollback " + res.apply_id + ")"); id.id = "apply-id";
      id.dataset.applyId = res.apply_id;
      box.appendChild(id);
    }
    show(box, true);
  }

  async function doRollback(id) {
    try {
      const res = await post("/api/rollback", { apply_id: id });
      error("");
      const box = $("result");
      box.textContent = "";
      const h = el("h3", null, "Rolled back apply " + res.rolled_back); h.id = "rolled-back";
      box.appendChild(h);
      box.appendChild(el("div", null, res.paths.length + " path(s) restored in the project; the changes are back in the session."));
      show(box, true);
      await loadState(true);
    } catch (e) { error("Not rolled back: " + e.message); }
  }

  function openEditor() {
    if (!current || !current.editable) return;
    const d = decisionOf(current.path);
    $("editor").value = d && d.content !== undefined ? d.content : current.new_text;
    show($("editor-box"), true);
    $("editor").focus();
  }

  function wire() {
    $("apply").addEventListener("click", () => doApply(false));
    $("file-approve").addEventListener("click", () => {
      const d = decisionOf(current.path);
      decide(current.path, d && d.decision === "approve" && !d.hunks && d.content === undefined ? null : "approve");
    });
    $("file-reject").addEventListener("click", () => {
      const d = decisionOf(current.path);
      decide(current.path, d && d.decision === "reject" ? null : "reject");
    });
    $("view-toggle").addEventListener("click", () => { split = !split; renderFileHead(); renderDiff(); });
    $("edit").addEventListener("click", openEditor);
    $("save-edit").addEventListener("click", () => {
      // a textarea gives every line break as LF: a CRLF file keeps its CRLF
      let text = $("editor").value;
      const orig = current.new_text || "";
      if (orig.includes("\r\n") && !/(^|[^\r])\n/.test(orig)) text = text.replace(/\r?\n/g, "\r\n");
      decisions[current.path] = { decision: "approve", content: text };
      show($("editor-box"), false);
      renderTree(); renderFileHead(); renderDiff(); renderSummary();
    });
    $("drop-edit").addEventListener("click", () => {
      delete decisions[current.path];
      show($("editor-box"), false);
      renderTree(); renderFileHead(); renderDiff(); renderSummary();
    });
    $("close-edit").addEventListener("click", () => show($("editor-box"), false));
    $("approve-all").addEventListener("click", () => {
      for (const c of entries()) if (!c.held_back && c.kind !== "refused") decisions[c.path] = { decision: "approve" };
      renderTree(); renderFileHead(); renderDiff(); renderSummary();
    });
    $("reject-all").addEventListener("click", () => {
      for (const c of entries()) decisions[c.path] = { decision: "reject" };
      renderTree(); renderFileHead(); renderDiff(); renderSummary();
    });
    $("clear-all").addEventListener("click", () => {
      for (const p of Object.keys(decisions)) delete decisions[p];
      renderTree(); renderFileHead(); renderDiff(); renderSummary();
    });
  }

  async function start() {
    wire();
    try {
      await loadState(false);
      document.body.dataset.ready = "1";
    } catch (e) { error(e.message); }
    setTimeout(poll, POLL_MS);
  }
  document.addEventListener("DOMContentLoaded", start);
})();
