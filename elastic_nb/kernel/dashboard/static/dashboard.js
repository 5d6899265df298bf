// The elastic_nb dashboard (anywidget ESM). See elastic_nb/dashboard/model.py for the state.
//
// One store per widget model holds the state: the snapshot trait to begin with, then every
// delta the kernel sends (custom messages, numbered by `seq`), with the same bounds as the
// kernel's. Views only draw the store: any number of them, none costs the kernel anything.

const STORES = new WeakMap();

function clone(x) {
  return JSON.parse(JSON.stringify(x ?? {}));
}

function fromSnapshot(snap) {
  const d = clone(snap);
  d.seq ??= 0;
  d.header ??= {};
  d.ranks ??= {};
  d.alerts ??= [];
  d.attempts ??= [];
  d.tails ??= {};
  d.all ??= [];
  d.progress ??= {};
  d.memory ??= {};
  d.limits ??= { tail: 1000, all: 2000, alerts: 100 };
  d.limits.memory ??= 300;
  d.limits.tail_chars ??= Infinity;
  d.limits.all_chars ??= Infinity;
  d.alertsSeen = d.alerts.length; // ever received: the list itself drops the oldest
  // The kernel's clock, for the elapsed time: local time minus this offset.
  d.offset = Date.now() / 1000 - (snap?.now ?? Date.now() / 1000);
  return d;
}

function trim(list, limit, chars = Infinity) {
  if (list.length > limit) list.splice(0, list.length - limit);
  if (chars === Infinity) return;
  // Characters too, oldest lines first, as DashboardState._trim does (the text is last).
  let size = 0;
  for (const line of list) size += line.at(-1).length;
  let drop = 0;
  while (drop < list.length && size > chars) size -= list[drop++].at(-1).length;
  if (drop) list.splice(0, drop);
}

// Fold one delta into the state, exactly as DashboardState does in the kernel.
function apply(d, delta) {
  if (delta.seq <= d.seq) return false; // already in the snapshot this store started from
  d.seq = delta.seq;
  d.offset = Date.now() / 1000 - delta.now;
  if (delta.header) {
    // A new attempt's ranks are new processes: their memory starts afresh (as in the kernel).
    if (delta.header.attempt !== undefined && delta.header.attempt !== d.header.attempt) d.memory = {};
    Object.assign(d.header, delta.header);
  }
  for (const [rank, chip] of Object.entries(delta.ranks ?? {})) {
    if (chip === null) delete d.ranks[rank]; // a smaller world: a node left
    else d.ranks[rank] = chip;
  }
  for (const a of delta.alerts ?? []) {
    // A story told as it goes (a replay): its new word takes the earlier one's place.
    const at = a.replaces === undefined ? -1 : d.alerts.findIndex((x) => x.n === a.replaces);
    if (at >= 0) {
      d.alerts[at] = a;
      (d.replaced ??= []).push(a);
    } else {
      d.alerts.push(a);
      d.alertsSeen += 1;
    }
  }
  trim(d.alerts, d.limits.alerts);
  if (delta.attempts) d.attempts = delta.attempts;
  for (const [rank, stream, texts] of delta.lines ?? []) {
    if (rank !== null) {
      const tail = (d.tails[rank] ??= []);
      for (const t of texts) tail.push([stream, t]);
      trim(tail, d.limits.tail, d.limits.tail_chars);
    }
    if (stream === "mark") continue; // an attempt's separator in a rank's tab: the all tab has its own
    for (const t of texts) d.all.push([rank, stream, t]);
    trim(d.all, d.limits.all, d.limits.all_chars);
  }
  for (const [rank, bar] of Object.entries(delta.progress ?? {})) {
    if (bar === null) delete d.progress[rank];
    else d.progress[rank] = bar;
  }
  for (const [rank, m] of Object.entries(delta.memory ?? {})) {
    const mine = (d.memory[rank] ??= { series: [], last: null });
    mine.series.push(...m.samples);
    trim(mine.series, d.limits.memory);
    mine.last = m.last;
  }
  if (delta.summary) d.summary = delta.summary;
  return true;
}

function storeOf(model) {
  let store = STORES.get(model);
  if (store) return store;
  store = { data: fromSnapshot(model.get("snapshot")), views: new Set() };
  STORES.set(model, store);
  model.on("msg:custom", (delta) => {
    if (delta && typeof delta.seq === "number" && apply(store.data, delta)) {
      for (const redraw of store.views) redraw(delta);
    }
  });
  model.on("change:snapshot", () => {
    const snap = model.get("snapshot");
    if ((snap?.seq ?? 0) > store.data.seq) {
      store.data = fromSnapshot(snap);
      for (const redraw of store.views) redraw(null);
    }
  });
  return store;
}

// ---- text ----------------------------------------------------------------------------------

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" };
function esc(s) {
  return String(s).replace(/[&<>"]/g, (c) => ESCAPES[c]);
}

const SGR = /\x1b\[([0-9;]*)m/g;
// A rank's block in an alert's stacks: "rank 3 · ...", across machines "node 1 (gpu-b) rank 3 · ...".
const RANK_BLOCK = /^(?:node \d+ \([^)]*\) )?rank \d+\b/;
const OTHER_ESCAPES = /\x1b(?:\[[0-9;?]*[A-Za-z]|\][^\x07]*\x07|[()][A-Za-z0-9])/g;

// ANSI SGR colours (what tqdm, loggers and torch print) to spans; other escapes dropped.
function ansi(text) {
  if (!text.includes("\x1b")) return esc(text);
  let out = "";
  let open = false;
  let last = 0;
  const classes = new Set();
  const flush = (chunk) => {
    out += esc(chunk.replace(OTHER_ESCAPES, ""));
  };
  for (const m of text.matchAll(SGR)) {
    flush(text.slice(last, m.index));
    last = m.index + m[0].length;
    const codes = m[1] === "" ? [0] : m[1].split(";").map(Number);
    for (let i = 0; i < codes.length; i++) {
      const c = codes[i];
      if (c === 0) classes.clear();
      else if (c === 1) classes.add("enb-b");
      else if (c === 3) classes.add("enb-i");
      else if (c === 4) classes.add("enb-u");
      else if (c === 22) classes.delete("enb-b");
      else if (c === 39) for (const k of [...classes]) k.startsWith("enb-fg") && classes.delete(k);
      else if ((c >= 30 && c <= 37) || (c >= 90 && c <= 97)) {
        for (const k of [...classes]) k.startsWith("enb-fg") && classes.delete(k);
        classes.add(`enb-fg${c >= 90 ? c - 90 + 8 : c - 30}`);
      } else if (c === 38 || c === 48) i += codes[i + 1] === 5 ? 2 : 4; // 256/true colour: skip
    }
    if (open) out += "</span>";
    open = classes.size > 0;
    if (open) out += `<span class="${[...classes].join(" ")}">`;
  }
  flush(text.slice(last));
  if (open) out += "</span>";
  return out;
}

function duration(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "";
  s = Math.max(0, s);
  if (s < 60) return `${s.toFixed(1)} s`;
  const m = Math.floor(s / 60);
  const h = Math.floor(m / 60);
  const ss = String(Math.floor(s % 60)).padStart(2, "0");
  return h ? `${h}:${String(m % 60).padStart(2, "0")}:${ss}` : `${m}:${ss}`;
}

function bytes(n) {
  if (n === null || n === undefined) return "?";
  if (n >= 2 ** 30) return `${(n / 2 ** 30).toFixed(1)} GiB`;
  if (n >= 2 ** 20) return `${Math.round(n / 2 ** 20)} MiB`;
  return `${Math.round(n / 2 ** 10)} KiB`;
}

// A rank's memory over its last minutes: host memory (a line) and GPU memory (a second line, if
// it holds any), on the job's scale: `tops` holds the highest figure of any rank of the job for
// each (index 1 host, 2 GPU), so a rank holding a third of another's fills a third of its box.
const SPARK_W = 120;
const SPARK_H = 22;
function sparkline(series, tops) {
  if (series.length < 2) return "";
  const t0 = series[0][0];
  const span = Math.max(series.at(-1)[0] - t0, 1);
  const line = (i, cls) => {
    const points = series.filter((p) => p[i] !== null && p[i] !== undefined);
    if (points.length < 2) return "";
    const top = tops[i] || Math.max(...points.map((p) => p[i])) || 1;
    const y = (v) => SPARK_H - 1 - (v / top) * (SPARK_H - 3);
    const xy = points
      .map((p) => `${(((p[0] - t0) / span) * SPARK_W).toFixed(1)},${y(p[i]).toFixed(1)}`)
      .join(" ");
    const x0 = (((points[0][0] - t0) / span) * SPARK_W).toFixed(1);
    const x1 = (((points.at(-1)[0] - t0) / span) * SPARK_W).toFixed(1);
    return `<polygon class="${cls} enb-spark-area" points="${x0},${SPARK_H} ${xy} ${x1},${SPARK_H}"/><polyline class="${cls}" points="${xy}"/>`;
  };
  return `<svg class="enb-spark" viewBox="0 0 ${SPARK_W} ${SPARK_H}" width="${SPARK_W}" height="${SPARK_H}" preserveAspectRatio="none">${line(1, "enb-spark-host")}${line(2, "enb-spark-gpu")}</svg>`;
}

// The job's scale: each figure's highest sample over every rank.
function memoryTops(memory) {
  const tops = { 1: 0, 2: 0 };
  for (const m of Object.values(memory)) {
    for (const p of m.series) for (const i of [1, 2]) tops[i] = Math.max(tops[i], p[i] ?? 0);
  }
  return tops;
}

// Host memory's change per minute over the last minute of samples (null: under 10 s of them).
function growthPerMinute(series) {
  const last = series.at(-1);
  const first = series.find((p) => p[0] >= last[0] - 60 && p[1] !== null);
  if (!first || last[0] - first[0] < 10 || last[1] === null) return null;
  return ((last[1] - first[1]) / (last[0] - first[0])) * 60;
}

// The rank whose host memory is at least twice every other's median: the outlier a person
// should look at first (null: none, or one rank).
const OUTLIER = 2;
function memoryOutlier(memory) {
  const held = Object.entries(memory)
    .filter(([, m]) => m.last?.rss)
    .map(([r, m]) => [r, m.last.rss]);
  if (held.length < 2) return null;
  const [rank, most] = held.reduce((a, b) => (b[1] > a[1] ? b : a));
  const others = held.filter(([r]) => r !== rank).map(([, v]) => v).sort((a, b) => a - b);
  const median = others[Math.floor(others.length / 2)];
  return most >= OUTLIER * median ? { rank, ratio: most / median } : null;
}

// The chip's memory: its sparkline, the latest figures, and in its title the peaks it shows.
// A multi-node round: its nodes and world, whether its beginning spent a restart (failures and
// departures do, arrivals do not), what the change took. Why it began is the row above's end.
function roundWords(r) {
  const spent = r.attempt === 0 ? "" : r.counted ? `restart ${r.restarts}` : "no restart spent";
  const took = [
    r.stop_s != null ? `stopping ${duration(r.stop_s)}` : "",
    r.rendezvous_s != null ? `rendezvous ${duration(r.rendezvous_s)}` : "",
    r.running_s != null ? `running after ${duration(r.running_s)}` : "waiting for its ranks",
  ].filter(Boolean).join(", ");
  return `<span class="enb-round"><span class="enb-round-nodes">${esc(r.nodes.join(", "))} · world size ${r.world_size}</span>
    ${spent ? `<span class="enb-round-spent${r.counted ? " enb-round-counted" : ""}">${spent}</span>` : ""}
    <span class="enb-round-took">${esc(took)}</span></span>`;
}

// The membership timeline as a picture: the job's time along, one lane per node (one machine:
// one lane), each attempt a bar from its start to its end coloured by how it ended, a node that
// left marked where it left. `now`: seconds into the job.
function timelinePicture(attempts, now) {
  const end = (a) => a.ended_s ?? now;
  const span = Math.max(now, ...attempts.map(end), 0.001);
  const pct = (s) => `${((Math.max(0, s) / span) * 100).toFixed(2)}%`;
  const lanes = [];
  for (const a of attempts) for (const n of a.round?.nodes ?? ["this machine"]) if (!lanes.includes(n)) lanes.push(n);
  const rows = lanes.map((lane) => {
    const marks = attempts.map((a, i) => {
      const nodes = a.round?.nodes ?? ["this machine"];
      if (!nodes.includes(lane)) return "";
      const how = a.outcome ?? (i < attempts.length - 1 ? (a.round && !attempts[i + 1].round?.counted ? "changed" : "restarted") : "running");
      const left = i < attempts.length - 1 && attempts[i + 1].round && !attempts[i + 1].round.nodes.includes(lane);
      const words = `attempt ${a.attempt} · ${duration(end(a) - a.started)}`;
      const bar = `<div class="enb-tl-bar enb-o-${esc(how)}" style="left:${pct(a.started)};width:${pct(end(a) - a.started)}" title="${esc(`${words}${a.why ? ` · ended: ${a.why}` : ""}`)}">${esc(words)}</div>`;
      const gone = left ? `<span class="enb-tl-left" style="left:${pct(end(a))}" title="${esc(a.why ?? `${lane} left`)}">✕ left</span>` : "";
      return bar + gone;
    });
    return `<div class="enb-tl-lane"><span class="enb-tl-name">${esc(lane)}</span><div class="enb-tl-track">${marks.join("")}</div></div>`;
  });
  const axis = `<div class="enb-tl-lane enb-tl-axis"><span class="enb-tl-name"></span><div class="enb-tl-track"><span style="left:0">0 s</span><span style="left:50%">${duration(span / 2)}</span><span style="right:0">${duration(span)}</span></div></div>`;
  return `<div class="enb-timeline">${rows.join("")}${axis}</div>`;
}

function memoryChip(m, tops, outlier) {
  if (!m?.last) return "";
  const last = m.last;
  const device = last.gpu ?? null;
  const cuda = last.cuda ?? null;
  // An ended rank's last look finds no process: its peak says what it held. Each figure with its
  // share of what bounds it: the host memory its ranks may use, the GPU's.
  const share = (n, of) => (of ? ` (${((100 * n) / of).toFixed(n / of < 0.1 ? 1 : 0)}% of ${bytes(of)})` : "");
  // (a figure wraps only before its share: "233 MiB host" / "(1.0% of 23.5 GiB)")
  const figures = last.rss != null ? [`${bytes(last.rss)} host${share(last.rss, last.limit)}`] : [];
  if (device) figures.push(`GPU ${device.index}: ${bytes(device.process)}${share(device.process, device.total)}`);
  else if (cuda) figures.push(`GPU ${cuda.device}: ${bytes(cuda.reserved)}${share(cuda.reserved, cuda.total)}`);
  const growth = growthPerMinute(m.series);
  if (m.series.length > 1) figures.push(`peak ${bytes(Math.max(...m.series.map((p) => p[1] ?? 0)))}`);
  if (growth !== null && Math.abs(growth) >= 2 ** 20) {
    figures.push(`${growth > 0 ? "+" : "−"}${bytes(Math.abs(growth))}/min`);
  }
  if (outlier) figures.push(`${outlier.ratio.toFixed(1)}× the others`);
  const peak = (i) => Math.max(...m.series.map((p) => p[i] ?? 0));
  const span = m.series.length > 1 ? m.series.at(-1)[0] - m.series[0][0] : 0;
  const title = [
    `host memory (RSS): ${bytes(last.rss)}, peak ${bytes(peak(1))} over the last ${duration(span)}`,
    device ? `GPU ${device.index}: this rank ${bytes(device.process)} (NVML), the device ${bytes(device.used)} of ${bytes(device.total)}` : "",
    cuda ? `torch's allocator: ${bytes(cuda.allocated)} allocated, ${bytes(cuda.reserved)} reserved, peak ${bytes(cuda.peak)} of ${bytes(cuda.total)}` : "",
  ]
    .filter(Boolean)
    .join("\n");
  const cls = outlier ? " enb-mem-outlier" : "";
  const fig = (f) => {
    const at = f.indexOf(" (");
    return at < 0
      ? `<span class="enb-fig">${esc(f)}</span>`
      : `<span class="enb-fig">${esc(f.slice(0, at))}</span> <span class="enb-fig-share">${esc(f.slice(at + 1))}</span>`;
  };
  return `<span class="enb-chip-mem${cls}" title="${esc(title)}">${sparkline(m.series, tops)}<span class="enb-chip-mem-text">${figures.map(fig).join(" · ")}</span></span>`;
}

// What --collective-timeout will do, once a rank has a process group (before, nothing can time
// out): each attempt fails within its share of the worst case, the cell within all of it (a
// session cell within one share: its failure restarts the session, not the cell).
function collectiveWords(h) {
  if (h.worst_case_s == null) return "";
  const n = (x) => String(+x.toFixed(1));
  const attempts = (h.max_restarts ?? 0) + 1;
  if (h.session) return `a stuck collective fails the cell within ${n(h.worst_case_s / attempts)} s`;
  return attempts > 1
    ? `a stuck collective fails its attempt within ${n(h.worst_case_s / attempts)} s, the cell within ${n(h.worst_case_s)} s`
    : `a stuck collective fails the cell within ${n(h.worst_case_s)} s`;
}

const RUNNING = new Set(["starting", "rendezvous", "running", "restarting"]);

// ---- the view ------------------------------------------------------------------------------

class View {
  constructor(el, store, model) {
    this.store = store;
    this.model = model;
    this.tab = "all";
    this.drawnAlerts = 0;
    el.classList.add("enb");
    el.innerHTML = `
      <div class="enb-header">
        <span class="enb-title">elastic_nb</span>
        <span class="enb-job"></span>
        <span class="enb-state"></span>
        <span class="enb-elapsed"></span>
        <span class="enb-world"></span>
        <span class="enb-restarts"></span>
        <span class="enb-worst"></span>
        <span class="enb-checkpoint"></span>
        <span class="enb-actions">
          <button class="enb-stacks" title="every rank's Python stack, now">Stacks</button>
          <button class="enb-stop" title="SIGTERM every rank, SIGKILL after the grace">Stop</button>
        </span>
      </div>
      <div class="enb-rundir"></div>
      <div class="enb-hint">■ Interrupt the kernel to stop every rank (they are gone within seconds).</div>
      <div class="enb-chips"></div>
      <div class="enb-alerts"></div>
      <div class="enb-attempts"></div>
      <details class="enb-logs" open>
        <summary class="enb-tabs" title="show or hide the logs"></summary>
        <pre class="enb-log"></pre>
        <div class="enb-logpath"></div>
      </details>
      <div class="enb-summary"></div>`;
    this.q = (sel) => el.querySelector(sel);
    this.q(".enb-stop").addEventListener("click", () => this.action("stop"));
    this.q(".enb-stacks").addEventListener("click", () => this.action("stacks"));
    this.q(".enb-chips").addEventListener("click", (e) => {
      const chip = e.target.closest(".enb-chip");
      if (chip) this.select(chip.dataset.rank);
    });
    this.q(".enb-tabs").addEventListener("click", (e) => {
      const tab = e.target.closest(".enb-tab");
      if (!tab) return; // the rest of the row opens or closes the logs
      e.preventDefault(); // a tab opens its log, it never closes the logs
      this.select(tab.dataset.tab);
    });
    this.timer = setInterval(() => {
      this.drawHeader();
      // A rank waiting for a paused one counts down to its collective's timeout.
      if (Object.values(this.data.ranks).some((c) => c.expires)) this.drawChips();
      if (!this.q(".enb-attempts").hidden) this.drawAttempts(); // the running bar grows
    }, 1000);
    this.redraw = (delta) => this.draw(delta);
    this.draw(null);
  }

  get data() {
    return this.store.data;
  }

  action(kind) {
    this.model.send({ kind });
    const button = this.q(kind === "stop" ? ".enb-stop" : ".enb-stacks");
    button.disabled = true;
    button.textContent = kind === "stop" ? "Stopping…" : "Asking…";
    if (kind === "stacks") {
      setTimeout(() => {
        button.disabled = false;
        button.textContent = "Stacks";
      }, 2000);
    }
  }

  select(tab) {
    this.tab = tab;
    this.q(".enb-logs").open = true;
    this.drawTabs();
    this.drawLog(true);
  }

  // A delta (or null: everything) arrived: redraw what it touched.
  draw(delta) {
    const all = delta === null;
    this.drawHeader();
    if (all || delta.ranks || delta.lines || delta.progress || delta.header || delta.memory) this.drawChips();
    if (all || delta.alerts) this.drawAlerts(all);
    if (all || delta.attempts) this.drawAttempts();
    if (all || delta.ranks) this.drawTabs();
    if (all || delta.progress || this.touches(delta.lines)) this.drawLog(false);
    if (all || delta.summary) this.drawSummary();
    // The cell raised the failure report right under the dashboard: its logs close (the
    // rank's traceback is in the error) and the verdict is on the cell's first screen.
    // Once, when the end arrives: a person may open them again.
    if ((all || delta.summary) && this.data.summary?.raised) this.q(".enb-logs").open = false;
  }

  touches(lines) {
    if (!lines) return false;
    return this.tab === "all" || lines.some(([rank]) => String(rank) === this.tab);
  }

  drawHeader() {
    const h = this.data.header;
    const running = RUNNING.has(h.state);
    const elapsed = running
      ? Date.now() / 1000 - this.data.offset - h.started
      : h.wall_s ?? Date.now() / 1000 - this.data.offset - h.started;
    this.q(".enb-job").textContent = h.session
      ? `session ${h.session} · cell ${h.job ?? ""}`
      : `job ${h.job ?? ""}`;
    const state = this.q(".enb-state");
    state.textContent = h.state ?? "";
    state.className = `enb-state enb-s-${h.state}`;
    this.q(".enb-elapsed").textContent = duration(elapsed);
    this.q(".enb-world").textContent = `${h.world_size} rank${h.world_size === 1 ? "" : "s"}`;
    // A multi-node job's restarts are its failures and departures, not its arrivals.
    const restarts = h.restarts ?? h.attempt;
    this.q(".enb-restarts").textContent = h.session
      ? `session attempt ${h.attempt} · restarts ${restarts}/${h.max_restarts}`
      : `restarts ${restarts}/${h.max_restarts}`;
    this.q(".enb-worst").textContent = h.collectives && running ? collectiveWords(h) : "";
    const saved = h.checkpoint;
    const checkpoint = this.q(".enb-checkpoint");
    checkpoint.hidden = !saved;
    if (saved) {
      const age = Date.now() / 1000 - this.data.offset - saved.time;
      checkpoint.textContent = `checkpoint: step ${saved.step} · ${duration(age)} ago${saved.bytes ? ` · ${bytes(saved.bytes)}` : ""}`;
      checkpoint.title = `${saved.how ?? ""}\n${saved.path}`;
    }
    this.q(".enb-rundir").textContent = `run dir: ${h.run_dir}`;
    this.q(".enb-actions").hidden = !(h.background && running);
    this.q(".enb-hint").hidden = !!h.background || !running;
    if (!running) clearInterval(this.timer);
  }

  lastLine(rank) {
    const bar = this.data.progress[rank];
    if (bar) return bar[1];
    const tail = this.data.tails[rank] ?? [];
    for (let i = tail.length - 1; i >= 0; i--) if (tail[i][0] !== "note" && tail[i][0] !== "mark") return tail[i][1];
    return "";
  }

  drawChips() {
    const ranks = Object.keys(this.data.ranks).sort((a, b) => a - b);
    const tops = memoryTops(this.data.memory);
    const outlier = memoryOutlier(this.data.memory);
    this.q(".enb-chips").innerHTML = ranks
      .map((r) => {
        const c = this.data.ranks[r];
        const last = this.lastLine(r).replace(OTHER_ESCAPES, "").replace(SGR, "");
        const title = [c.detail, c.pid ? `pid ${c.pid}` : "", c.log ? `log: ${c.log}` : ""]
          .filter(Boolean)
          .join("\n");
        const node = c.node ? `<span class="enb-chip-node">${esc(c.node)}</span>` : "";
        return `<div class="enb-chip enb-s-${esc(c.state)}" data-rank="${esc(r)}" title="${esc(title)}">
          <span class="enb-chip-rank">rank ${esc(r)}</span>${node}
          <span class="enb-chip-label">${esc(c.label ?? c.state)}</span>${this.timeoutLeft(c)}
          <span class="enb-chip-last">${esc(last)}</span>${memoryChip(this.data.memory[r], tops, outlier?.rank === r ? outlier : null)}</div>`;
      })
      .join("");
  }

  // What a rank waiting for a paused one has left of its collective's timeout (kernel clock).
  timeoutLeft(c) {
    if (!c.expires) return "";
    const left = c.expires - (Date.now() / 1000 - this.data.offset);
    const words = left <= 0 ? "its timeout has run out" : `times out in ${left < 60 ? `${Math.round(left)} s` : duration(left)}`;
    return ` <span class="enb-chip-timeout">${words}</span>`;
  }

  drawAlerts(all) {
    const box = this.q(".enb-alerts");
    if (all) {
      box.innerHTML = "";
      this.drawnAlerts = this.data.alertsSeen - this.data.alerts.length;
    }
    // Alerts grow (the oldest fall off past the limit), and one may take an earlier one's
    // place: draw those, keeping the open/closed state of the others drawn already.
    for (const a of this.data.replaced ?? []) {
      box.querySelector(`.enb-alert[data-n="${a.replaces}"]`)?.replaceWith(this.alertElement(a));
    }
    this.data.replaced = [];
    const alerts = this.data.alerts;
    const fresh = Math.min(alerts.length, this.data.alertsSeen - this.drawnAlerts);
    for (const a of alerts.slice(alerts.length - fresh)) box.appendChild(this.alertElement(a));
    while (box.children.length > this.data.limits.alerts) box.firstChild.remove();
    this.drawnAlerts = this.data.alertsSeen;
  }

  alertElement(a) {
    const div = document.createElement("div");
    div.className = `enb-alert enb-${a.severity}`;
    div.dataset.kind = a.kind;
    div.dataset.n = a.n;
    const rank = a.rank === null || a.rank === undefined ? "" : `<span class="enb-alert-rank">rank ${esc(a.rank)}</span>`;
    div.innerHTML = `<div class="enb-alert-title">${rank}<span class="enb-alert-kind">${esc(a.kind)}</span> ${esc(a.title)}</div>`;
    if (a.text) {
      const details = document.createElement("details");
      details.open = a.severity === "error";
      details.innerHTML = `<summary>details</summary>${this.alertText(a.text)}`;
      div.appendChild(details);
      if (this.data.summary?.in_error?.includes(a.n)) this.inError(details);
    }
    return div;
  }

  // The error under the dashboard says what this alert's detail says: closed, and saying so.
  inError(details) {
    details.open = false;
    details.querySelector("summary").textContent = "details (in the error below)";
  }

  // Stacks of several ranks ("rank N · ..." blocks) side by side; any other text as it is.
  alertText(text) {
    const blocks = [];
    for (const line of text.split("\n")) {
      if (RANK_BLOCK.test(line)) blocks.push([line]);
      else if (blocks.length) blocks[blocks.length - 1].push(line);
      else blocks.push([line]);
    }
    const perRank = blocks.filter((b) => RANK_BLOCK.test(b[0]));
    if (perRank.length < 2 || perRank.length !== blocks.length) {
      return `<pre class="enb-alert-text">${ansi(text)}</pre>`;
    }
    return `<div class="enb-stacks-grid">${blocks
      .map((b) => `<pre class="enb-alert-text">${ansi(b.join("\n"))}</pre>`)
      .join("")}</div>`;
  }

  // The timeline: its picture, then a row of words an attempt (its time, how each rank ended,
  // its round, why it ended). A restart's words are said there, not again as an alert above.
  drawAttempts() {
    const attempts = this.data.attempts;
    const box = this.q(".enb-attempts");
    // One attempt's story is the header's and the alerts': the timeline is for restarts, and
    // for a multi-node job's rounds (its members, from the first one).
    box.hidden = attempts.length < 2 && !attempts[0]?.round;
    this.q(".enb-alerts").classList.toggle("enb-restarts-in-timeline", !box.hidden);
    if (box.hidden) return;
    const rows = attempts
      .map((a, i) => {
        const ranks = Object.keys(a.ranks)
          .sort((x, y) => x - y)
          .map((r) => `<span class="enb-dot enb-s-${esc(a.ranks[r].state)}" title="rank ${esc(r)}: ${esc(a.ranks[r].label)}">${esc(r)}</span>`)
          .join("");
        const round = a.round ? roundWords(a.round) : "";
        const last = i === attempts.length - 1;
        const ended = a.why && !(last && a.outcome === "succeeded") ? `<span class="enb-attempt-why">ended: ${esc(a.why)}</span>` : "";
        const took = a.ended_s != null ? `, ${duration(a.ended_s - a.started)}` : "";
        return `<div class="enb-attempt" data-attempt="${a.attempt}"><span class="enb-attempt-n">attempt ${a.attempt}</span>
          <span class="enb-attempt-t">from ${duration(a.started)}${took}</span>${ranks}${round}${ended}</div>`;
      })
      .join("");
    box.innerHTML = timelinePicture(attempts, this.now()) + rows;
  }

  // Seconds into the job: now while it runs, its wall time once it ended.
  now() {
    const h = this.data.header;
    return RUNNING.has(h.state) || h.wall_s == null ? Date.now() / 1000 - this.data.offset - h.started : h.wall_s;
  }

  drawTabs() {
    // A rank of a smaller world (its node left) has no chip any more, but keeps its tab and lines.
    const ranks = Object.keys({ ...this.data.tails, ...this.data.ranks }).sort((a, b) => a - b);
    const tabs = [["all", "all ranks"], ...ranks.map((r) => [r, `rank ${r}`])];
    this.q(".enb-tabs").innerHTML = tabs
      .map(([id, name]) => {
        const state = id === "all" ? "" : ` enb-s-${esc(this.data.ranks[id]?.state ?? "")}`;
        const sel = id === this.tab ? " enb-selected" : "";
        return `<button class="enb-tab${state}${sel}" data-tab="${esc(id)}">${esc(name)}</button>`;
      })
      .join("");
  }

  drawLog(force) {
    const pre = this.q(".enb-log");
    const atBottom = force || pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 24;
    let html;
    if (this.tab === "all") {
      html = this.data.all
        .map(([rank, stream, text]) => {
          const who = rank === null ? "" : `<span class="enb-prefix enb-r${rank % 8}">[rank ${rank}]</span> `;
          return `<span class="enb-line enb-${stream}">${who}${ansi(text)}</span>`;
        })
        .join("\n");
      const bars = Object.entries(this.data.progress)
        .map(([rank, [, text]]) => `\n<span class="enb-line enb-progress"><span class="enb-prefix enb-r${rank % 8}">[rank ${rank}]</span> ${ansi(text)}</span>`)
        .join("");
      html += bars;
    } else {
      const tail = this.data.tails[this.tab] ?? [];
      html = tail.map(([stream, text]) => `<span class="enb-line enb-${stream}">${ansi(text)}</span>`).join("\n");
      const bar = this.data.progress[this.tab];
      if (bar) html += `\n<span class="enb-line enb-progress">${ansi(bar[1])}</span>`;
    }
    pre.innerHTML = html || '<span class="enb-line enb-note">no output yet</span>';
    if (atBottom) pre.scrollTop = pre.scrollHeight;
    const chip = this.data.ranks[this.tab];
    this.q(".enb-logpath").textContent =
      this.tab === "all"
        ? `showing the last ${this.data.limits.all} lines of all ranks · full logs: ${this.data.header.run_dir}/attempt-${this.data.header.attempt}/`
        : `showing the last ${this.data.limits.tail} lines · full log: ${chip?.log ?? ""} (stderr: .err)`;
  }

  // The end's own words, only where nothing else says them: the summary line is printed
  // under the dashboard, a failure's headline is its alert's title (model.py: end).
  drawSummary() {
    const s = this.data.summary;
    const box = this.q(".enb-summary");
    box.hidden = !s?.headline;
    if (!s) return;
    box.className = `enb-summary enb-s-${s.outcome}`;
    box.innerHTML = s.headline ? `<div class="enb-headline">${esc(s.headline)}</div>` : "";
    for (const n of s.in_error ?? []) {
      const details = this.q(`.enb-alert[data-n="${Number(n)}"] details`);
      if (details) this.inError(details);
    }
  }

  dispose() {
    clearInterval(this.timer);
  }
}

export default {
  initialize({ model }) {
    storeOf(model); // before any delta is handled: anywidget holds comm messages until now
  },
  render({ model, el }) {
    const store = storeOf(model);
    const view = new View(el, store, model);
    store.views.add(view.redraw);
    return () => {
      store.views.delete(view.redraw);
      view.dispose();
    };
  },
};
