// The right-hand panel: the active chat's system prompt and sampling settings, and the server
// card fed by `stats` frames (polled once a second) with a small SVG sparkline of tokens/s.
import {h, s} from './dom.js';
import {PRESETS, CUSTOM, presetById, systemPromptOf} from './presets.js';
import {sampling} from './store.js';

const $ = (id) => document.getElementById(id);
const STATS_EVERY_MS = 1000;
const HISTORY = 60;

export class Panel {
  constructor(book, conn) {
    this.book = book;
    this.conn = conn;
    this.history = new Array(HISTORY).fill(0);
    $('preset').replaceChildren(...[...PRESETS, CUSTOM].map((p) => h('option', {value: p.id}, p.name)));
    $('preset').addEventListener('change', (e) => {
      const chat = book.active;
      book.setSystem(chat, e.target.value, e.target.value === 'custom' ? systemPromptOf(chat) : chat.system);
      this.render();
    });
    $('system').addEventListener('input', (e) => {
      book.setSystem(book.active, 'custom', e.target.value);
      $('preset').value = 'custom';
      this.renderShared();
    });
    for (const name of ['temperature', 'top_p', 'max_tokens', 'seed']) {
      $(name).addEventListener('input', () => this.readSetting(name));
      $(name).addEventListener('change', () => this.render());
    }
    conn.addEventListener('frame', (e) => {
      if (e.detail.type === 'stats') this.renderStats(e.detail);
      if (e.detail.type === 'ready') { this.renderServer(e.detail); this.render(); }  // (the model's defaults)
    });
    setInterval(() => { if (!document.hidden) conn.send({type: 'stats'}); }, STATS_EVERY_MS);
    this.renderSpark();
  }

  readSetting(name) {
    const chat = this.book.active;
    const raw = $(name).value;
    const value = name === 'seed' ? (raw === '' ? null : Math.max(0, Math.trunc(Number(raw)))) : Number(raw);
    if (name !== 'seed' && (raw === '' || !Number.isFinite(value))) return;
    const limit = this.conn.info?.max_model_len || Infinity;
    this.book.updateSettings(chat, {[name]: name === 'max_tokens' ? Math.max(1, Math.min(Math.trunc(value), limit)) : value});
    if (name === 'temperature' || name === 'top_p') $(`${name}-out`).textContent = value.toFixed(2);
  }

  /** Show the active chat's settings. */
  render() {
    const chat = this.book.active;
    $('preset').value = presetById(chat.presetId).id;
    $('system').value = systemPromptOf(chat);
    const st = chat.settings;
    const used = sampling(st, this.conn.info?.defaults);
    for (const name of ['temperature', 'top_p']) {
      // not set in this chat: the model's default (or the UI's), said so until the slider is moved
      $(name).value = used[name];
      $(`${name}-out`).textContent = Number(used[name]).toFixed(2) + (st[name] == null ? ' · default' : '');
    }
    $('max_tokens').value = st.max_tokens;
    $('seed').value = st.seed ?? '';
    this.renderShared();
  }

  renderShared() {
    const chat = this.book.active;
    const prompt = systemPromptOf(chat);
    const others = this.book.chats.filter((c) => c !== chat && prompt && systemPromptOf(c) === prompt).length;
    $('shared-note').textContent = !prompt
      ? 'No system prompt, so no shared prefix.'
      : others
        ? `Shared with ${others} other chat${others === 1 ? '' : 's'}: served from the prefix cache (see “cached” under answers).`
        : 'Chats with the same system prompt share it as a cached prefix.';
  }

  renderServer(info) {
    const ctx = Number.isFinite(info.max_model_len) ? `${info.max_model_len.toLocaleString()}-token context · ` : '';
    $('model-name').replaceChildren(h('span', {class: 'model-id'}, info.model),
      h('span', {class: 'model-sub'}, `${ctx}up to ${info.max_inflight} chats at once`));
    if (Number.isFinite(info.max_model_len)) $('max_tokens').max = info.max_model_len;
  }

  renderStats(st) {
    const pct = (x) => (!Number.isFinite(x) ? '—' : x > 0 && x < 0.001 ? '<0.1%' : `${(x * 100).toFixed(x < 0.1 ? 1 : 0)}%`);
    $('st-running').textContent = st.num_running ?? '—';
    $('st-waiting').textContent = st.num_waiting ?? '—';
    $('st-kv').textContent = pct(st.kv_usage);
    $('st-kv-bar').style.width = `${Math.min(100, 100 * (st.kv_usage || 0))}%`;
    $('st-hit').textContent = pct(st.prefix_cache_hit_rate);
    $('st-hit-bar').style.width = `${Math.min(100, 100 * (st.prefix_cache_hit_rate || 0))}%`;
    const tps = Number(st.generation_tokens_per_s);
    $('st-tps').textContent = Number.isFinite(tps) ? `${tps.toFixed(tps < 10 ? 1 : 0)} tok/s` : '— tok/s';
    this.history.push(Number.isFinite(tps) ? tps : 0);
    if (this.history.length > HISTORY) this.history.shift();
    this.renderSpark();
  }

  renderSpark() {
    const w = 240, hgt = 48, pad = 2;
    const data = this.history;
    const max = Math.max(1, ...data);
    const step = (w - 2 * pad) / (HISTORY - 1);
    const x0 = w - pad - (data.length - 1) * step;
    const pts = data.map((v, i) => [x0 + i * step, hgt - pad - (v / max) * (hgt - 2 * pad)]);
    const line = pts.map(([x, y], i) => `${i ? 'L' : 'M'}${x.toFixed(1)} ${y.toFixed(1)}`).join(' ');
    const area = `${line} L${pts.at(-1)[0].toFixed(1)} ${hgt} L${pts[0][0].toFixed(1)} ${hgt} Z`;
    const peak = Math.max(...data);
    const svg = s('svg', {viewBox: `0 0 ${w} ${hgt}`, preserveAspectRatio: 'none', role: 'img',
      'aria-label': `Generation speed over the last ${data.length} seconds, peak ${peak.toFixed(1)} tokens per second`},
      s('path', {class: 'spark-area', d: area}),
      s('path', {class: 'spark-line', d: line}));
    $('spark').replaceChildren(svg);
  }
}
