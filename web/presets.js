// System-prompt presets. Chats that pick the same preset send byte-identical system prompts,
// so the server computes that prefix once and serves it from its prefix cache.

export const PRESETS = [
  {id: 'assistant', name: 'Helpful assistant', hue: 174,
    prompt: 'You are a helpful assistant. Answer clearly and concisely. Put code in fenced code blocks.'},
  {id: 'terse', name: 'Terse', hue: 32,
    prompt: 'You are terse. Answer in as few words as possible, without preamble.'},
  {id: 'engineer', name: 'Senior engineer', hue: 262,
    prompt: 'You are a senior software engineer. Prefer working code with short explanations, ' +
      'point out edge cases, and say when you are unsure.'},
  {id: 'tutor', name: 'Patient tutor', hue: 330,
    prompt: 'You are a patient tutor. Explain step by step, check understanding with a short ' +
      'question at the end, and avoid jargon unless you define it.'},
  {id: 'none', name: 'No system prompt', hue: 220, prompt: ''},
];

export const CUSTOM = {id: 'custom', name: 'Custom', hue: 0, prompt: ''};

export function presetById(id) {
  return PRESETS.find((p) => p.id === id) ?? CUSTOM;
}

/** The system prompt a chat sends: its preset's text, or its own text when custom. */
export function systemPromptOf(chat) {
  return chat.presetId === 'custom' ? chat.system ?? '' : presetById(chat.presetId).prompt;
}
