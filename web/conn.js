// The page's single WebSocket (docs/protocol.md, v1): connect, authenticate with `hello`,
// reconnect with jittered backoff, and re-emit every server frame as a 'frame' event.
// Events: 'state' (this.state changed), 'frame' (detail = parsed frame), 'lost' (socket dropped).

const BACKOFF_MS = [500, 1000, 2000, 4000, 8000, 15000];
const KEY_NAME = 'sluice.apiKey';

export class Connection extends EventTarget {
  constructor(url) {
    super();
    this.url = url;
    this.ws = null;
    this.state = 'idle';   // idle | connecting | ready | waiting | auth
    this.info = null;      // the last `ready` frame: model, max_model_len, max_inflight
    this.attempt = 0;
    this.retryAt = 0;
    this.authMessage = '';
    this.timer = 0;
    addEventListener('online', () => { if (this.state === 'waiting') this.connect(); });
  }

  get apiKey() {
    return sessionStorage.getItem(KEY_NAME) ?? localStorage.getItem(KEY_NAME) ?? '';
  }

  /** Store the key (for this tab, or also on this device) and reconnect with it. */
  setApiKey(key, remember) {
    sessionStorage.setItem(KEY_NAME, key);
    if (remember) localStorage.setItem(KEY_NAME, key);
    else localStorage.removeItem(KEY_NAME);
    this.connect();
  }

  forgetApiKey() {
    sessionStorage.removeItem(KEY_NAME);
    localStorage.removeItem(KEY_NAME);
  }

  connect() {
    clearTimeout(this.timer);
    if (this.ws && this.ws.readyState <= WebSocket.OPEN) return;
    this.setState('connecting');
    const ws = new WebSocket(this.url);
    ws.sentKey = this.apiKey;
    this.ws = ws;
    ws.onopen = () => {
      // A keyed server closes with 1008 on any first frame but `hello`, so without a key a ping
      // is the probe that reveals one is needed; an open server answers `hello` with `ready`.
      ws.send(JSON.stringify(ws.sentKey ? {type: 'hello', api_key: ws.sentKey} : {type: 'ping', data: 'probe'}));
    };
    ws.onmessage = (event) => this.onFrame(ws, event.data);
    ws.onclose = (event) => this.onClose(ws, event);
  }

  /** Send a frame if the socket is ready; returns whether it was sent. */
  send(frame) {
    if (this.state !== 'ready') return false;
    this.ws.send(JSON.stringify(frame));
    return true;
  }

  onFrame(ws, data) {
    if (ws !== this.ws) return;
    let frame;
    try { frame = JSON.parse(data); } catch { return; }
    if (frame.type === 'ready') {
      this.info = frame;
      this.attempt = 0;
      this.setState('ready');
    } else if (frame.type === 'error' && frame.code === 'unauthorized') {
      this.refused(ws);
      return;
    }
    this.dispatchEvent(new CustomEvent('frame', {detail: frame}));
  }

  onClose(ws, event) {
    if (ws !== this.ws) return;
    this.ws = null;
    this.dispatchEvent(new CustomEvent('lost', {detail: {code: event.code}}));
    if (event.code === 1008) this.refused(ws);
    if (ws.refused) return;
    const delay = BACKOFF_MS[Math.min(this.attempt, BACKOFF_MS.length - 1)] * (0.75 + Math.random() * 0.5);
    this.attempt += 1;
    this.retryAt = Date.now() + delay;
    this.timer = setTimeout(() => this.connect(), delay);
    this.setState('waiting');
  }

  /** Authentication failed on `ws` (error `unauthorized` and/or close 1008): ask for a key. */
  refused(ws) {
    if (ws.refused) return;
    ws.refused = true;
    if (this.ws === ws) {
      this.ws = null;
      ws.close();
      this.dispatchEvent(new CustomEvent('lost', {detail: {code: 1008}}));
    }
    if (ws.sentKey) this.forgetApiKey();
    this.authMessage = ws.sentKey
      ? 'The server did not accept that key. Check it and try again.'
      : 'This server needs an API key before it will stream answers.';
    this.setState('auth');
  }

  setState(state) {
    this.state = state;
    this.dispatchEvent(new CustomEvent('state', {detail: state}));
  }
}
