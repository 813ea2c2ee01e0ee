// Entry point: wires the connection, the chat model, the view and the panel to the page,
// and owns the page-level chrome (composer, drawers, connection status, key dialog, toasts).
import {Connection} from './conn.js';
import {ChatBook} from './chats.js';
import {View} from './view.js';
import {Panel} from './panel.js';
import {icon} from './dom.js';

const $ = (id) => document.getElementById(id);
const scheme = location.protocol === 'https:' ? 'wss' : 'ws';
// The key a load balancer in front of several replicas routes on (README "Scaling"): one per browser, so every
// turn of its chats lands on the replica that has their prefixes cached. A single server ignores it.
const route = localStorage.getItem('sluice.route') ?? (() => {
  const id = Array.from(crypto.getRandomValues(new Uint8Array(8)), (b) => b.toString(16).padStart(2, '0')).join('');
  localStorage.setItem('sluice.route', id);
  return id;
})();
const conn = new Connection(`${scheme}://${location.host}/v1/ws?route=${route}`);
const book = new ChatBook(conn);
const view = new View(book);
const panel = new Panel(book, conn);
const prompt = $('prompt');

// --- static icons -------------------------------------------------------------------------
$('new-chat').prepend(icon('plus'));
$('open-sidebar').append(icon('menu'));
$('open-panel').append(icon('sliders'));
for (const b of document.querySelectorAll('.drawer-close')) b.append(icon('close'));

// --- model → view ---------------------------------------------------------------------------
book.addEventListener('list', () => view.renderList());
book.addEventListener('chat', (e) => {
  if (e.detail.chat === book.active) { view.renderChat(); panel.render(); syncComposer(); }
});
book.addEventListener('message', (e) => {
  view.update(e.detail.chat, e.detail.msg);
  if (e.detail.chat === book.active) syncComposer();
});
book.addEventListener('system', () => view.renderHeader());
book.addEventListener('notice', (e) => toast(e.detail));

// --- sidebar --------------------------------------------------------------------------------
$('new-chat').addEventListener('click', () => {
  book.create();
  closeDrawers();
  prompt.focus();
});
view.list.addEventListener('click', async (e) => {
  const button = e.target.closest('button[data-action]');
  const chat = button && book.byId(button.closest('[data-id]').dataset.id);
  if (!chat) return;
  if (button.dataset.action === 'open') {
    book.select(chat.id);
    closeDrawers();
  } else if (button.dataset.action === 'rename') {
    const title = await view.editTitle(chat);
    if (title !== null) book.rename(chat, title); else view.renderList();
    if (chat === book.active) view.renderHeader();
  } else if (button.dataset.action === 'delete') {
    const token = book.remove(chat);
    view.focusRow(book.active);
    toast(`Deleted “${chat.title || 'New chat'}”.`, {label: 'Undo', run: () => book.undo(token)});
  }
});

// --- transcript -----------------------------------------------------------------------------
view.transcript.addEventListener('click', (e) => {
  const button = e.target.closest('button[data-action]');
  if (!button) return;
  const action = button.dataset.action;
  if (action === 'suggest') {
    prompt.value = button.textContent;
    submit();
  } else if (action === 'copy-code') {
    copy(button.closest('figure').querySelector('code').textContent, button);
  } else if (action === 'copy') {
    copy(view.messageOf(button.closest('article'))?.content ?? '', button);
  } else if (action === 'regenerate') {
    book.regenerate(book.active);
  }
});

async function copy(text, button) {
  let ok = false;
  try {
    await navigator.clipboard.writeText(text);
    ok = true;
  } catch {
    ok = copyWithSelection(text);  // plain http on a LAN host is not a secure context: no clipboard API
  }
  toast(ok ? 'Copied to the clipboard' : 'Copy failed: select the text and copy it by hand');
  if (ok && button.classList.contains('code-copy')) {
    button.textContent = 'Copied';
    setTimeout(() => { button.textContent = 'Copy'; }, 1500);
  }
}

function copyWithSelection(text) {
  const area = document.createElement('textarea');
  area.value = text;
  area.setAttribute('readonly', '');
  area.className = 'sr-only';
  document.body.append(area);
  area.select();
  const ok = document.execCommand('copy');
  area.remove();
  return ok;
}

// --- composer -------------------------------------------------------------------------------
let composerState = '';
function syncComposer() {
  const live = book.streaming(book.active);
  const state = `${live} ${conn.state}`;
  if (state === composerState) return;  // called on every delta: touch the DOM only on change
  composerState = state;
  const send = $('send');
  send.replaceChildren(icon(live ? 'stop' : 'send'));
  send.classList.toggle('stop', live);
  send.setAttribute('aria-label', live ? 'Stop answer' : 'Send message');
  send.disabled = !live && conn.state !== 'ready';
}

function submit() {
  const chat = book.active;
  if (book.streaming(chat)) { book.stop(chat); return; }
  const text = prompt.value;
  if (!text.trim()) return;
  if (conn.state !== 'ready') { toast('Not connected yet — your message is kept in the box.'); return; }
  prompt.value = '';
  autosize();
  book.send(chat, text);
}

$('composer').addEventListener('submit', (e) => { e.preventDefault(); submit(); });
prompt.addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    if (!book.streaming(book.active)) submit();
  }
});
prompt.addEventListener('input', autosize);

function autosize() {
  prompt.style.height = 'auto';
  prompt.style.height = `${Math.min(prompt.scrollHeight, 240)}px`;
}

// --- drawers (narrow screens) ---------------------------------------------------------------
function openDrawer(id) {
  closeDrawers();
  $(id).classList.add('open');
  $(id === 'sidebar' ? 'open-sidebar' : 'open-panel').setAttribute('aria-expanded', 'true');
  $('scrim').hidden = false;
  $(id).querySelector('.drawer-close')?.focus();
}

function closeDrawers() {
  for (const id of ['sidebar', 'panel']) $(id).classList.remove('open');
  $('open-sidebar').setAttribute('aria-expanded', 'false');
  $('open-panel').setAttribute('aria-expanded', 'false');
  $('scrim').hidden = true;
}

$('open-sidebar').addEventListener('click', () => openDrawer('sidebar'));
$('open-panel').addEventListener('click', () => openDrawer('panel'));
$('scrim').addEventListener('click', closeDrawers);
for (const b of document.querySelectorAll('.drawer-close')) b.addEventListener('click', closeDrawers);
addEventListener('keydown', (e) => { if (e.key === 'Escape' && !$('scrim').hidden) closeDrawers(); });

// --- connection status and API key ----------------------------------------------------------
let tick = 0;
function renderConn() {
  clearInterval(tick);
  const state = conn.state;
  const text = {
    idle: 'Offline', connecting: 'Connecting…', auth: 'API key needed',
    ready: `Connected${conn.info ? ` · ${conn.info.model}` : ''}`,
  }[state];
  const action = $('conn-action');
  $('conn').dataset.state = state;
  $('conn-mini').dataset.state = state;
  action.hidden = state !== 'waiting' && state !== 'auth';
  action.textContent = state === 'auth' ? 'Enter key' : 'Retry now';
  $('conn-text').textContent = state === 'waiting' ? 'Disconnected · retrying' : text;
  $('conn-eta').textContent = '';
  if (state === 'waiting') {  // the countdown sits outside the live region: announced once, not every second
    const paint = () => { $('conn-eta').textContent = ` in ${Math.max(0, Math.ceil((conn.retryAt - Date.now()) / 1000))}s`; };
    paint();
    tick = setInterval(paint, 1000);
  }
  $('conn-mini').title = $('conn-text').textContent;
  if (state === 'auth') askForKey();
  syncComposer();
}

function askForKey() {
  const dialog = $('key-dialog');
  $('key-message').textContent = conn.authMessage;
  if (!dialog.open) dialog.showModal();
  $('api-key').focus();
}

$('conn-action').addEventListener('click', () => (conn.state === 'auth' ? askForKey() : conn.connect()));
$('key-form').addEventListener('submit', (e) => {
  e.preventDefault();
  const key = $('api-key').value.trim();
  if (!key) return;
  $('key-dialog').close();
  $('api-key').value = '';
  conn.setApiKey(key, $('remember-key').checked);
});
$('key-cancel').addEventListener('click', () => $('key-dialog').close());
conn.addEventListener('state', renderConn);

// --- toasts ---------------------------------------------------------------------------------
let toastTimer = 0;
function toast(text, action) {
  const el = $('toast');
  el.replaceChildren(document.createTextNode(text));
  if (action) {
    const b = document.createElement('button');
    b.type = 'button';
    b.className = 'link-btn';
    b.textContent = action.label;
    b.addEventListener('click', () => { action.run(); el.hidden = true; });
    el.append(b);
  }
  el.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { el.hidden = true; }, action ? 6000 : 2500);
}

// --- start ----------------------------------------------------------------------------------
view.renderList();
view.renderChat();
panel.render();
renderConn();
conn.connect();
