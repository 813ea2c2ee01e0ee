// Conversation persistence in localStorage. Chats that were streaming when the page went away
// come back marked as cut off: their request died with the old socket.

const KEY = 'sluice.chats.v1';

// temperature and top_p null: the model's (the `ready` frame's `defaults`, from its generation config), else FALLBACK's
export const DEFAULT_SETTINGS = Object.freeze({temperature: null, top_p: null, max_tokens: 512, seed: null});
const FALLBACK = Object.freeze({temperature: 0.7, top_p: 1.0});

/** The temperature and top_p a chat samples with: its own once set, else the model's defaults, else the UI's. */
export function sampling(settings, defaults) {
  const pick = (name) => settings[name] ?? defaults?.[name] ?? FALLBACK[name];
  return {temperature: pick('temperature'), top_p: pick('top_p')};
}

export function newId() {
  const bytes = crypto.getRandomValues(new Uint8Array(6));
  return Array.from(bytes, (b) => b.toString(36).padStart(2, '0')).join('').slice(0, 10);
}

export function newChat(template = {}) {
  const now = Date.now();
  return {
    id: newId(), title: '', createdAt: now, updatedAt: now,
    presetId: template.presetId ?? 'assistant', system: template.system ?? '',
    settings: {...DEFAULT_SETTINGS, ...(template.settings ?? {})},
    messages: [],
  };
}

function sanitize(chat) {
  if (!chat || typeof chat.id !== 'string' || !Array.isArray(chat.messages)) return null;
  chat.settings = {...DEFAULT_SETTINGS, ...(chat.settings ?? {})};
  for (const msg of chat.messages) {
    msg.content = String(msg.content ?? '');
    if (msg.reasoning != null) msg.reasoning = String(msg.reasoning);
    if (msg.status === 'streaming' || msg.status === 'pending') msg.status = 'cut';
  }
  return chat;
}

/** → {chats: Chat[], activeId: string|null}; never throws on corrupt storage. */
export function load() {
  try {
    const raw = JSON.parse(localStorage.getItem(KEY) ?? 'null');
    const chats = (raw?.chats ?? []).map(sanitize).filter(Boolean);
    return {chats, activeId: raw?.activeId ?? null};
  } catch {
    return {chats: [], activeId: null};
  }
}

/** Returns false when storage is full or unavailable (private mode); the UI keeps working. */
export function save(chats, activeId) {
  try {
    localStorage.setItem(KEY, JSON.stringify({version: 1, chats, activeId}));
    return true;
  } catch {
    return false;
  }
}
