// Tiny DOM builders. Text always enters the document as text nodes: nothing here parses HTML.

const SVG_NS = 'http://www.w3.org/2000/svg';

function setAttrs(el, attrs) {
  for (const [key, value] of Object.entries(attrs)) {
    if (value == null || value === false) continue;
    if (key.startsWith('on') && typeof value === 'function') el.addEventListener(key.slice(2), value);
    else if (key === 'class') el.setAttribute('class', value);
    else if (key === 'dataset') Object.assign(el.dataset, value);
    else el.setAttribute(key, value === true ? '' : String(value));
  }
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child == null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** h('button', {class: 'x', onclick}, 'label', childNode) → HTMLElement. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

/** Same as h() for SVG elements. */
export function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

/** An inline icon from the sprite-free set below, drawn with SVG paths (aria-hidden). */
export function icon(name) {
  const paths = ICONS[name] ?? [];
  return s('svg', {class: 'icon', viewBox: '0 0 24 24', 'aria-hidden': 'true', focusable: 'false'},
    paths.map((d) => s('path', {d})));
}

const ICONS = {
  plus: ['M12 5v14', 'M5 12h14'],
  send: ['M4 12l16-8-6 16-2.5-6.5z', 'M11.5 13.5L20 4'],
  stop: ['M7 7h10v10H7z'],
  copy: ['M9 9h10v10H9z', 'M5 15V5h10'],
  check: ['M5 12.5l4.5 4.5L19 7.5'],
  redo: ['M20 11a8 8 0 1 0-2.3 5.7', 'M20 4v7h-7'],
  edit: ['M4 20h4L19 9l-4-4L4 16z', 'M13.5 6.5l4 4'],
  trash: ['M5 7h14', 'M10 7V4h4v3', 'M7 7l1 13h8l1-13'],
  menu: ['M4 7h16', 'M4 12h16', 'M4 17h16'],
  sliders: ['M4 7h9', 'M17 7h3', 'M15 5v4', 'M4 17h3', 'M11 17h9', 'M9 15v4', 'M4 12h13', 'M20 12h0'],
  close: ['M6 6l12 12', 'M18 6L6 18'],
  key: ['M14 10a4 4 0 1 0-3.5 4L12 16h2v2h2v2h4v-3l-6.5-6.5', 'M7.5 9.5h0'],
};
