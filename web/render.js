// Safe text rendering: model and user text → DOM nodes. Fenced code blocks become <pre><code>,
// `inline code` becomes <code>; everything else is text nodes. No HTML is ever parsed.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const INLINE_CODE = /`([^`\n]+)`/g;

/** Split text into blocks: {kind: 'text', text} | {kind: 'code', lang, text, open}. */
export function parseBlocks(text) {
  const blocks = [];
  const lines = text.split('\n');
  let prose = [];
  const flushProse = () => {
    const body = prose.join('\n');
    if (body.trim()) blocks.push({kind: 'text', text: body.replace(/^\n+|\n+$/g, '')});
    prose = [];
  };
  for (let i = 0; i < lines.length; i++) {
    const open = FENCE.exec(lines[i]);
    if (!open) { prose.push(lines[i]); continue; }
    flushProse();
    const fence = open[1];
    const code = [];
    let closed = false;
    for (i += 1; i < lines.length; i++) {
      const line = lines[i].trim();
      if (line.startsWith(fence[0].repeat(fence.length)) && /^([`~])\1*$/.test(line)) { closed = true; break; }
      code.push(lines[i]);
    }
    blocks.push({kind: 'code', lang: open[2] || '', text: code.join('\n'), open: !closed});
  }
  flushProse();
  return blocks;
}

function inline(text) {
  const frag = document.createDocumentFragment();
  let last = 0;
  for (const m of text.matchAll(INLINE_CODE)) {
    if (m.index > last) frag.append(document.createTextNode(text.slice(last, m.index)));
    const code = document.createElement('code');
    code.textContent = m[1];
    frag.append(code);
    last = m.index + m[0].length;
  }
  if (last < text.length) frag.append(document.createTextNode(text.slice(last)));
  return frag;
}

function codeBlock({lang, text}) {
  const figure = document.createElement('figure');
  figure.className = 'code';
  const bar = document.createElement('figcaption');
  const label = document.createElement('span');
  label.textContent = lang || 'code';
  const copy = document.createElement('button');
  copy.type = 'button';
  copy.className = 'code-copy';
  copy.dataset.action = 'copy-code';
  copy.textContent = 'Copy';
  copy.setAttribute('aria-label', `Copy ${lang || 'code'} block`);
  bar.append(label, copy);
  const pre = document.createElement('pre');
  const code = document.createElement('code');
  code.textContent = text;
  pre.tabIndex = 0;
  pre.append(code);
  figure.append(bar, pre);
  return figure;
}

/** Render message text into a DocumentFragment built only from elements and text nodes. */
export function renderText(text) {
  const frag = document.createDocumentFragment();
  for (const block of parseBlocks(String(text ?? ''))) {
    if (block.kind === 'code') { frag.append(codeBlock(block)); continue; }
    for (const para of block.text.split(/\n{2,}/)) {
      const p = document.createElement('p');
      p.append(inline(para));
      frag.append(p);
    }
  }
  return frag;
}
