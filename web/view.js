// Sidebar and transcript rendering. Message text goes through renderText (text nodes only);
// streaming updates are coalesced to one re-render per animation frame.
import {h, icon} from './dom.js';
import {renderText} from './render.js';
import {presetById} from './presets.js';

const $ = (id) => document.getElementById(id);

const SUGGESTIONS = [
  'Explain prefix caching to a new engineer in one paragraph.',
  'Write a Python function that merges two sorted lists.',
  'Give me three names for a river-themed coffee shop.',
];

function fmt(n, digits = 0) {
  return Number.isFinite(n) ? n.toLocaleString(undefined, {maximumFractionDigits: digits}) : '—';
}

/** Decode speed: tokens after the first over the time after the first token. */
export function tokensPerSecond(meta) {
  const {completion_tokens: n, ttft_ms: ttft, total_ms: total} = meta;
  if (!(n > 0) || !(total > 0)) return NaN;
  if (n > 1 && total > ttft) return ((n - 1) * 1000) / (total - ttft);
  return (n * 1000) / total;
}

function chip(stat, label, value, title) {
  return h('span', {class: 'chip', 'data-stat': stat, title}, label ? h('span', {class: 'chip-label'}, label) : null, h('b', {}, value));
}

function footer(msg) {
  const meta = msg.meta ?? {};
  switch (msg.status) {
    case 'pending':
      return [h('span', {class: 'state'}, 'Waiting for the server…')];
    case 'streaming':
      return [h('span', {class: 'state live'}, 'Streaming'), chip('tokens', '', `${fmt(msg.tokens)} tok`, 'Tokens so far'),
        meta.cached_tokens > 0 ? chip('cached', '', `${fmt(meta.cached_tokens)} cached`, 'Prompt tokens served from the prefix cache') : null];
    case 'cut':
      return [h('span', {class: 'badge warn', 'data-stat': 'finish'}, 'cut off'),
        h('span', {class: 'state'}, 'The connection dropped while this answer was streaming.')];
    case 'error':
      return [h('span', {class: 'badge error', 'data-stat': 'finish'}, 'error'), h('span', {class: 'state'}, msg.error)];
    default: {
      const reason = meta.finish_reason ?? msg.status;
      return [
        chip('ttft', 'TTFT', `${fmt(meta.ttft_ms)} ms`, 'Time to first token (server-side)'),
        chip('tps', '', `${fmt(tokensPerSecond(meta), 1)} tok/s`, 'Decode speed'),
        chip('prompt', '', `${fmt(meta.prompt_tokens)} prompt`, 'Prompt tokens'),
        chip('cached', '', `${fmt(meta.cached_tokens)} cached`, 'Prompt tokens served from the prefix cache'),
        chip('completion', '', `${fmt(meta.completion_tokens)} out`, 'Completion tokens'),
        h('span', {class: `badge ${reason === 'cancelled' ? 'warn' : reason === 'length' ? 'muted' : 'ok'}`, 'data-stat': 'finish'}, reason),
      ];
    }
  }
}

export class View {
  constructor(book) {
    this.book = book;
    this.nodes = new Map();    // message object → its <article>, for the active chat
    this.dirty = new Set();
    this.frame = 0;
    this.list = $('chat-list');
    this.transcript = $('transcript');
  }

  renderList() {
    const {book} = this;
    const items = book.chats.map((chat) => {
      const preset = presetById(chat.presetId);
      const live = book.streaming(chat);
      const title = chat.title || 'New chat';
      const open = h('button', {type: 'button', class: 'chat-open', 'data-action': 'open', 'aria-current': chat.id === book.activeId ? 'true' : null},
        h('span', {class: 'dot', 'aria-hidden': 'true'}),
        h('span', {class: 'chat-title'}, title),
        h('span', {class: 'chat-sub'}, live ? 'Streaming…' : preset.name));
      const li = h('li', {class: 'chat-item', 'data-id': chat.id, 'data-live': live ? 'true' : null},
        open,
        h('span', {class: 'chat-actions'},
          h('button', {type: 'button', class: 'icon-btn sm', 'data-action': 'rename', 'aria-label': `Rename “${title}”`}, icon('edit')),
          h('button', {type: 'button', class: 'icon-btn sm', 'data-action': 'delete', 'aria-label': `Delete “${title}”`}, icon('trash'))));
      li.style.setProperty('--hue', preset.hue);
      return li;
    });
    this.list.replaceChildren(...items);
  }

  /** Swap the title of a sidebar row for an input; resolves on Enter/blur (or null on Escape). */
  editTitle(chat) {
    const row = this.list.querySelector(`[data-id="${CSS.escape(chat.id)}"] .chat-title`);
    if (!row) return Promise.resolve(null);
    const input = h('input', {class: 'rename-input', value: chat.title || '', 'aria-label': 'Chat name', maxlength: 120});
    row.replaceWith(input);
    input.focus();
    input.select();
    return new Promise((resolve) => {
      let done = false;
      const end = (value) => { if (!done) { done = true; resolve(value); } };
      input.addEventListener('keydown', (e) => {
        if (e.key !== 'Enter' && e.key !== 'Escape') return;
        e.preventDefault();
        end(e.key === 'Enter' ? input.value : null);
        setTimeout(() => this.focusRow(chat), 0);  // keyboard users land back on the renamed chat
      });
      input.addEventListener('blur', () => end(input.value));
    });
  }

  focusRow(chat) {
    this.list.querySelector(`[data-id="${CSS.escape(chat.id)}"] .chat-open`)?.focus();
  }

  renderChat() {
    const chat = this.book.active;
    this.nodes.clear();
    this.dirty.clear();
    this.renderHeader();
    if (!chat.messages.length) {
      this.transcript.replaceChildren(this.emptyState());
      return;
    }
    const last = chat.messages.at(-1);
    this.transcript.replaceChildren(...chat.messages.map((msg) => this.article(msg, msg === last)));
    this.scrollToEnd(true);
  }

  renderHeader() {
    const chat = this.book.active;
    const preset = presetById(chat.presetId);
    $('chat-title').textContent = chat.title || 'New chat';
    document.title = chat.title ? `${chat.title} · Sluice` : 'Sluice';
    $('preset-badge').textContent = preset.name;
    $('preset-badge').style.setProperty('--hue', preset.hue);
  }

  emptyState() {
    return h('div', {class: 'empty'},
      h('div', {class: 'empty-logo', 'aria-hidden': 'true'}, 'S'),
      h('h2', {}, 'Start a conversation'),
      h('p', {}, 'Every chat streams over one connection. Run several at once and switch between them freely.'),
      h('div', {class: 'suggestions'}, SUGGESTIONS.map((text) =>
        h('button', {type: 'button', class: 'suggestion', 'data-action': 'suggest'}, text))));
  }

  article(msg, isLast) {
    const mine = msg.role === 'user';
    const node = h('article', {class: `msg ${msg.role}`, 'data-status': msg.status ?? null},
      mine ? null : h('div', {class: 'avatar', 'aria-hidden': 'true'}, 'S'),
      h('div', {class: 'bubble'},
        h('h3', {class: 'sr-only'}, mine ? 'You said' : 'Sluice answered'),
        // a reasoning model's thinking (--reasoning-parser), folded; made once so a reader's open/closed choice stays
        mine ? null : h('details', {class: 'thinking', hidden: true}, h('summary', {}), h('div', {class: 'thinking-body'})),
        h('div', {class: 'body'}),
        h('div', {class: 'under'},
          mine ? null : h('footer', {class: 'meta'}),
          h('div', {class: 'actions'},
            h('button', {type: 'button', class: 'icon-btn sm', 'data-action': 'copy', 'aria-label': mine ? 'Copy message' : 'Copy answer'}, icon('copy')),
            !mine && isLast ? h('button', {type: 'button', class: 'icon-btn sm', 'data-action': 'regenerate', 'aria-label': 'Regenerate answer'}, icon('redo')) : null))));
    this.nodes.set(msg, node);
    this.paint(msg, node);
    return node;
  }

  paint(msg, node) {
    const streaming = msg.status === 'streaming' || msg.status === 'pending';
    node.dataset.status = msg.status ?? '';
    node.setAttribute('aria-busy', streaming ? 'true' : 'false');
    const thinking = node.querySelector('.thinking');
    if (thinking && msg.reasoning) {
      thinking.hidden = false;
      thinking.querySelector('summary').textContent = streaming && !msg.content ? 'Thinking…' : 'Reasoning';
      thinking.querySelector('.thinking-body').replaceChildren(renderText(msg.reasoning));
    }
    node.querySelector('.body').replaceChildren(renderText(msg.content));
    node.querySelector('.meta')?.replaceChildren(...footer(msg));
    const regen = node.querySelector('[data-action="regenerate"]');
    if (regen) regen.disabled = streaming;
  }

  /** A message changed: repaint it on the next frame if it belongs to the visible chat. */
  update(chat, msg) {
    if (chat !== this.book.active || !this.nodes.has(msg)) return;
    this.dirty.add(msg);
    if (!this.frame) this.frame = requestAnimationFrame(() => this.flush());
  }

  flush() {
    this.frame = 0;
    const stick = this.nearBottom();
    for (const msg of this.dirty) {
      const node = this.nodes.get(msg);
      if (node) this.paint(msg, node);
    }
    this.dirty.clear();
    if (stick) this.scrollToEnd();
  }

  nearBottom() {
    const t = this.transcript;
    return t.scrollHeight - t.scrollTop - t.clientHeight < 120;
  }

  scrollToEnd(force = false) {
    if (force || this.nearBottom()) this.transcript.scrollTop = this.transcript.scrollHeight;
  }

  messageOf(node) {
    for (const [msg, el] of this.nodes) if (el === node) return msg;
    return null;
  }
}
