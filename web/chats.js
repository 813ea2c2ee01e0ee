// The conversation model: chats, their messages, and the chat requests in flight on the shared
// socket. No DOM here. Events: 'list' (sidebar changed), 'chat' (a chat's message list changed),
// 'message' (detail {chat, msg}: one message's text or status changed), 'system' (a chat's system
// prompt changed), 'notice' (detail: text for the user).
import {load, save, newChat, sampling} from './store.js';
import {systemPromptOf} from './presets.js';

const ERROR_HINTS = {
  too_many_inflight: 'Too many answers streaming on this connection; wait for one to finish.',
  overloaded: 'The server queue is full; try again in a moment.',
  prompt_too_long: 'This conversation no longer fits the model’s context; start a new chat.',
};

export class ChatBook extends EventTarget {
  constructor(conn) {
    super();
    this.conn = conn;
    const stored = load();
    this.chats = stored.chats;
    this.activeId = stored.activeId;
    this.inflight = new Map();   // request id → {chat, msg}
    this.seq = 0;
    this.saveTimer = 0;
    if (!this.chats.length) this.chats.push(newChat());
    if (!this.byId(this.activeId)) this.activeId = this.chats[0].id;
    conn.addEventListener('frame', (e) => this.onFrame(e.detail));
    conn.addEventListener('lost', () => this.onLost());
    addEventListener('pagehide', () => this.saveNow());
  }

  get active() { return this.byId(this.activeId); }

  byId(id) { return this.chats.find((c) => c.id === id); }

  streaming(chat) {
    for (const {chat: c} of this.inflight.values()) if (c === chat) return true;
    return false;
  }

  create() {
    const current = this.active;
    const chat = newChat(current && {presetId: current.presetId, system: current.system, settings: current.settings});
    this.chats.unshift(chat);
    this.select(chat.id);
    return chat;
  }

  select(id) {
    if (!this.byId(id)) return;
    this.activeId = id;
    this.changed('list');
    this.changed('chat', {chat: this.active});
  }

  rename(chat, title) {
    chat.title = title.trim().slice(0, 120);
    this.changed('list');
  }

  /** Point a chat at a preset, or at 'custom' with its own text; applies from its next request. */
  setSystem(chat, presetId, text = chat.system) {
    chat.presetId = presetId;
    chat.system = text;
    this.changed('list');
    this.changed('system', {chat});
  }

  updateSettings(chat, patch) {
    Object.assign(chat.settings, patch);
    this.saveSoon();
  }

  /** Remove a chat (cancelling its answer); returns a token for undo(). */
  remove(chat) {
    this.stop(chat);
    const index = this.chats.indexOf(chat);
    this.chats.splice(index, 1);
    if (!this.chats.length) this.chats.push(newChat(chat));
    if (this.activeId === chat.id) this.activeId = this.chats[Math.min(index, this.chats.length - 1)].id;
    this.changed('list');
    this.changed('chat', {chat: this.active});
    return {chat, index};
  }

  undo({chat, index}) {
    this.chats.splice(Math.min(index, this.chats.length), 0, chat);
    this.select(chat.id);
  }

  /** Append a user message and ask for an answer. */
  send(chat, text) {
    if (!text.trim() || this.streaming(chat)) return;
    if (!chat.title) chat.title = text.trim().split('\n')[0].slice(0, 60);
    chat.messages.push({role: 'user', content: text});
    this.ask(chat);
  }

  /** Drop the last answer and ask again with the same history. */
  regenerate(chat) {
    if (this.streaming(chat)) return;
    const last = chat.messages.at(-1);
    if (last?.role === 'assistant') chat.messages.pop();
    if (chat.messages.at(-1)?.role === 'user') this.ask(chat);
  }

  stop(chat) {
    for (const [id, entry] of this.inflight) {
      if (entry.chat !== chat) continue;
      if (!this.conn.send({type: 'cancel', id})) this.finish(id, {status: 'cut'});
    }
  }

  ask(chat) {
    const messages = [];
    const system = systemPromptOf(chat);
    if (system) messages.push({role: 'system', content: system});
    for (const m of chat.messages) {
      // an answer that was all reasoning (cut off while thinking) is a turn with no text: roles keep alternating
      if (m.role === 'user' || (m.role === 'assistant' && m.status !== 'error' && (m.content || m.reasoning))) {
        messages.push({role: m.role, content: m.content});
      }
    }
    const msg = {role: 'assistant', content: '', status: 'pending', tokens: 0, meta: null, error: ''};
    chat.messages.push(msg);
    chat.updatedAt = Date.now();
    const id = `${chat.id}-${++this.seq}`;
    const {max_tokens, seed} = chat.settings;
    const {temperature, top_p} = sampling(chat.settings, this.conn.info?.defaults);
    const frame = {type: 'chat', id, messages, max_tokens, temperature, top_p};
    if (Number.isInteger(seed)) frame.seed = seed;
    if (this.conn.send(frame)) {
      this.inflight.set(id, {chat, msg});
    } else {
      msg.status = 'error';
      msg.error = 'Not connected, so nothing was sent. Regenerate once the connection is back.';
    }
    this.changed('chat', {chat});
    this.changed('list');
  }

  onFrame(frame) {
    const entry = frame.id != null ? this.inflight.get(frame.id) : undefined;
    if (frame.type === 'error' && !entry) {
      if (frame.code !== 'unauthorized' && frame.code !== 'unknown_id') {
        this.changed('notice', `${frame.code}: ${frame.message}`);
      }
      return;
    }
    if (!entry) return;
    const {msg} = entry;
    switch (frame.type) {
      case 'start':
        msg.status = 'streaming';
        msg.meta = {prompt_tokens: frame.prompt_tokens, cached_tokens: frame.cached_tokens};
        break;
      case 'delta':
        msg.status = 'streaming';
        msg.content += frame.text;
        if (frame.reasoning) msg.reasoning = (msg.reasoning ?? '') + frame.reasoning;
        msg.tokens += frame.tokens ?? 0;
        break;
      case 'done':
        this.finish(frame.id, {
          status: frame.finish_reason === 'cancelled' ? 'cancelled' : 'done',
          meta: {...frame.usage, ...frame.timing, finish_reason: frame.finish_reason},
        });
        return;
      case 'error':
        this.finish(frame.id, {status: 'error', error: ERROR_HINTS[frame.code] ?? `${frame.code}: ${frame.message}`});
        return;
      default:
        return;
    }
    this.changed('message', {chat: entry.chat, msg});
  }

  finish(id, patch) {
    const entry = this.inflight.get(id);
    if (!entry) return;
    this.inflight.delete(id);
    Object.assign(entry.msg, patch);
    this.changed('message', {chat: entry.chat, msg: entry.msg});
    this.changed('list');
  }

  onLost() {
    for (const id of [...this.inflight.keys()]) this.finish(id, {status: 'cut'});
  }

  changed(type, detail) {
    if (type !== 'notice') this.saveSoon();
    this.dispatchEvent(new CustomEvent(type, {detail}));
  }

  saveSoon() {
    if (!this.saveTimer) this.saveTimer = setTimeout(() => this.saveNow(), 300);
  }

  saveNow() {
    clearTimeout(this.saveTimer);
    this.saveTimer = 0;
    if (!save(this.chats, this.activeId)) this.dispatchEvent(new CustomEvent('notice', {detail: 'Browser storage is full; recent chats will not survive a reload.'}));
  }
}
