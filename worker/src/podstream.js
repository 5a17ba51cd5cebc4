// @ts-check
// A pod's stream asked for continuous usage: what the pod has made so far, and what the
// client sees.
//
// The router asks every pod stream for `stream_options: {include_usage: true,
// continuous_usage_stats: true}` (forward.js upstreamBody): vLLM then puts the usage so far on
// every event, its first (role-only) event included, with `prompt_tokens` as soon as the
// prompt's prefill is done, and a last usage event (`"choices": []`) with the totals. So a
// stream cut anywhere (the client hangs up, the pod breaks) is charged what the pod made
// until then, not an estimate (docs/worker.md, "Every token, whoever hangs up").
//
// A `Tally` keeps that count cheaply: a reference to the last usage object read (bytes and
// where), parsed once, when the stream ends or is cut. vLLM's continuous usage is per choice
// (`completion_tokens` of that event's choice, `prompt_tokens` of its prompt), so a request
// of several choices or prompts reads every event's usage and choice index instead.
//
// The client gets the stream it asked for (`pumpPod`): the per-event usage is cut out of each
// event's bytes unless it asked for continuous usage itself, and the last usage event is taken
// out unless it asked `include_usage`. Cutting is a search back from the event's end (vLLM
// writes `usage` last) and one copy; the event is never decoded or parsed.

import { contentChars, streamCut } from "./usage.js";

const decoder = new TextDecoder();
const LF = 10;
const CR = 13;
const QUOTE = 0x22;
const COLON = 0x3a;
const COMMA = 0x2c;
const OPEN = 0x7b; // {
const CLOSE = 0x7d; // }
const BRACKET = 0x5b; // [
const END_BRACKET = 0x5d; // ]
const G = 0x67; // the "g" of "usage": rarer than its "u" or "s" in text, so the search back stops less often
const USAGE = [QUOTE, 0x75, 0x73, 0x61, G, 0x65, QUOTE]; // "usage"
const CHOICES_KEY = [QUOTE, 0x63, 0x68, 0x6f, 0x69, 0x63, 0x65, 0x73, QUOTE]; // "choices"

/** Whether b[at..] spells `word`. */
function spells(b, at, word) {
  if (at < 0 || at + word.length > b.length) return false;
  for (let i = 0; i < word.length; i++) if (b[at + i] !== word[i]) return false;
  return true;
}

/**
 * The last usage object of b[from, to) (`"usage":{`, blanks allowed around the colon):
 * [start of `"usage"`, start of the object, end of the object (after its `}`)], or null. The
 * object's values are numbers, null and objects of numbers (vLLM's `*_details`): its braces
 * balance with no string to skip. An object not closed within `to` is not taken; an earlier
 * one is. A key spelt `"usage"` with its quotes unescaped is JSON's structure, never text.
 */
export function lastUsageAt(b, from, to) {
  // A loop, not lastIndexOf: the key is a few dozen bytes from an event's end, and a call
  // into the runtime's search costs more than that many comparisons.
  for (let g = to - 1; g >= from + 4; g--) {
    if (b[g] !== G) continue;
    const k = g - 4; // the opening quote of "usage"
    if (b[g + 2] !== QUOTE || !spells(b, k, USAGE)) continue;
    let o = g + 3;
    while (o < to && blank(b[o])) o++;
    if (b[o] !== COLON) continue;
    o++;
    while (o < to && blank(b[o])) o++;
    if (b[o] !== OPEN) continue;
    let depth = 0;
    for (let i = o; i < to; i++) {
      const c = b[i];
      if (c === OPEN) depth++;
      else if (c === CLOSE && --depth === 0) return [k, o, i + 1];
    }
  }
  return null;
}

function blank(c) {
  return c === 32 || c === 9 || c === LF || c === CR;
}

/**
 * Whether the event b[from, to) whose usage key starts at `key` is a stream's last usage event
 * (`"choices":[]`). vLLM writes `choices` just before `usage`: `],` there settles it (`[],`
 * yes, `}],` no) without a scan; another order is scanned for.
 */
function isLast(b, from, key) {
  let a = key - 1;
  while (a > from && blank(b[a])) a--;
  if (b[a] === COMMA) {
    a--;
    while (a > from && blank(b[a])) a--;
    if (b[a] === END_BRACKET) {
      a--;
      while (a > from && blank(b[a])) a--;
      return b[a] === BRACKET;
    }
  }
  return noChoices(b, from, key);
}

/** Whether the event b[from, to) has `"choices":[]` (the last usage event of a stream). */
function noChoices(b, from, to) {
  for (let i = b.indexOf(BRACKET, from); i >= 0 && i < to; i = b.indexOf(BRACKET, i + 1)) {
    let j = i - 1;
    while (j > from && blank(b[j])) j--;
    if (b[j] !== COLON) continue;
    j--;
    while (j > from && blank(b[j])) j--;
    if (!spells(b, j - CHOICES_KEY.length + 1, CHOICES_KEY)) continue;
    let k = i + 1;
    while (k < to && blank(b[k])) k++;
    return b[k] === END_BRACKET;
  }
  return false;
}

/** {prompt, completion} of the usage object in b[from, to), or null. */
function parseUsage(b, from, to) {
  try {
    const u = JSON.parse(decoder.decode(b.subarray(from, to)));
    const prompt = count(u && u.prompt_tokens);
    const completion = count(u && u.completion_tokens);
    return { prompt, completion };
  } catch {
    return null;
  }
}

function count(v) {
  return typeof v === "number" && v > 0 ? Math.min(Math.floor(v), Number.MAX_SAFE_INTEGER) : 0;
}

/** The first `"index":N` of the event b[from, to) (its choice's), else 0. */
function choiceIndex(b, from, to) {
  const text = decoder.decode(b.subarray(from, Math.min(to, from + 4096)));
  const m = /"choices"\s*:\s*\[\s*\{[^]*?"index"\s*:\s*(\d+)/.exec(text);
  return m ? Number(m[1]) : 0;
}

/**
 * What a pod's stream has reported so far. `choices`: the `n` (or `best_of`) of the request,
 * `prompts`: its prompt count (usage.js promptCount); with either above one, every event's
 * usage is read by choice.
 */
export class Tally {
  constructor(choices = 1, prompts = 1) {
    this.perChoice = choices > 1 || prompts > 1 ? new Map() : null;
    this.choices = Math.max(1, choices);
    this.bytes = null; // the bytes holding the last usage object read, and where it is
    this.from = 0;
    this.to = 0;
    this.final = null; // the last usage event's, once read
    this.parsed = null; // the last usage object read, when parsed at once
    this.events = 0; // events with a usage object
    this.chars = 0; // generated text passed on while no event had usage (a server without continuous usage)
  }

  /**
   * An event's usage object b[from, to) was read; `last`: the stream's last usage event.
   * `lazy`: `b` is the router's own to keep (never written on, nor read into again), so it is
   * kept and parsed only if the stream is cut; else it is parsed now.
   */
  seen(b, from, to, last, event0 = from, event1 = to, lazy = false) {
    this.events++;
    if (last) {
      this.final = parseUsage(b, from, to);
      return;
    }
    if (this.perChoice !== null) {
      const u = parseUsage(b, from, to);
      if (u) this.perChoice.set(choiceIndex(b, event0, event1), u);
      return;
    }
    if (lazy) {
      this.bytes = b;
      this.from = from;
      this.to = to;
      this.parsed = null;
    } else {
      this.bytes = null;
      this.parsed = parseUsage(b, from, to);
    }
  }

  /** Bytes of whole or partial events (an assembled answer's window): their last usage object. */
  feed(b) {
    if (this.perChoice !== null) {
      eachEvent(b, 0, b.length, (s, e) => {
        const at = lastUsageAt(b, s, e);
        if (at) this.seen(b, at[1], at[2], isLast(b, s, at[0]), s, e);
      });
      return;
    }
    const at = lastUsageAt(b, 0, b.length);
    if (at) this.seen(b, at[1], at[2], isLast(b, Math.max(0, b.lastIndexOf(LF, at[0])), at[0]));
  }

  /**
   * The usage known so far: the last usage event's, else the sum of the choices' last counts
   * (a prompt counted once for all the choices it has), else null: the stream reported none.
   */
  usage() {
    if (this.final) return this.final;
    if (this.perChoice !== null) {
      if (this.perChoice.size === 0) return null;
      const prompts = new Map(); // a prompt's choices are indexes prompt*n .. prompt*n + n - 1
      let completion = 0;
      for (const [i, u] of this.perChoice) {
        completion += u.completion;
        const p = Math.floor(i / this.choices);
        prompts.set(p, Math.max(prompts.get(p) ?? 0, u.prompt));
      }
      let prompt = 0;
      for (const v of prompts.values()) prompt += v;
      return { prompt, completion };
    }
    return this.bytes === null ? this.parsed : parseUsage(this.bytes, this.from, this.to);
  }
}

/** Call `each(start, end)` for every event of b[from, to) (an event ends after a blank line, or at `to`). */
function eachEvent(b, from, to, each) {
  let s = from;
  for (let i = b.indexOf(LF, from); i >= 0 && i < to; i = b.indexOf(LF, i + 1)) {
    if (b[i + 1] === LF) {
      each(s, i + 2);
      s = i + 2;
      i++;
    } else if (b[i + 1] === CR && b[i + 2] === LF) {
      each(s, i + 3);
      s = i + 3;
      i += 2;
    }
  }
  if (s < to) each(s, to);
}

/** The end of the last whole event of b (after its blank line), or 0. */
function wholeEvents(b) {
  for (let i = b.length - 1; i > 0; i = b.lastIndexOf(LF, i - 1)) {
    if (b[i] !== LF) continue;
    if (b[i - 1] === LF) return i + 1;
    if (b[i - 1] === CR && b[i - 2] === LF) return i + 1;
  }
  return 0;
}

/**
 * What the client's stream shows of whole events `b`: the per-event usage cut out (unless
 * `want.continuous`), the last usage event taken out (unless `want.usage`); each usage read
 * into `tally` first. `b` itself when nothing changes.
 */
export function clientEvents(b, want, tally) {
  if (want.continuous) {
    if (tally.perChoice !== null) {
      eachEvent(b, 0, b.length, (s, e) => {
        const at = lastUsageAt(b, s, e);
        if (at) tally.seen(b, at[1], at[2], isLast(b, s, at[0]), s, e);
      });
    } else {
      const at = lastUsageAt(b, 0, b.length);
      if (at) tally.seen(b, at[1], at[2], isLast(b, Math.max(0, b.lastIndexOf(LF, at[0])), at[0]));
    }
    return b;
  }
  // The common chunk: one event (its first blank line is its end), its usage cut out.
  const end = b.indexOf(LF);
  if (end >= 0 && end + 2 === b.length && b[end + 1] === LF) {
    const at = lastUsageAt(b, 0, b.length);
    if (at === null) return b;
    const last = isLast(b, 0, at[0]);
    tally.seen(b, at[1], at[2], last, 0, b.length, true);
    if (last) return want.usage ? b : null;
    let a = at[0];
    while (a > 0 && blank(b[a - 1])) a--;
    if (b[a - 1] === COMMA) return spliced(b, a - 1, at[2]);
  }
  /** @type {number[]} */
  const cuts = []; // [from, to) ranges taken out
  eachEvent(b, 0, b.length, (s, e) => {
    const at = lastUsageAt(b, s, e);
    if (at === null) return;
    const last = isLast(b, s, at[0]);
    tally.seen(b, at[1], at[2], last, s, e, true); // `b` itself is not written: an event changes
    if (last) {
      if (!want.usage) cuts.push(s, e);
      return;
    }
    // `,"usage":{...}` (or `"usage":{...},` when it comes first), blanks around the comma with it
    let a = at[0];
    while (a > s && blank(b[a - 1])) a--;
    if (b[a - 1] === COMMA) {
      cuts.push(a - 1, at[2]);
      return;
    }
    let z = at[2];
    while (z < e && blank(b[z])) z++;
    cuts.push(at[0], b[z] === COMMA ? z + 1 : at[2]);
  });
  if (cuts.length === 0) return b;
  let removed = 0;
  for (let i = 0; i < cuts.length; i += 2) removed += cuts[i + 1] - cuts[i];
  if (removed === b.length) return null;
  const out = new Uint8Array(b.length - removed);
  let to = 0;
  let at = 0;
  for (let i = 0; i < cuts.length; i += 2) {
    out.set(b.subarray(at, cuts[i]), to);
    to += cuts[i] - at;
    at = cuts[i + 1];
  }
  out.set(b.subarray(at), to);
  return out;
}

/** `b` without b[from, to). */
function spliced(b, from, to) {
  const out = new Uint8Array(b.length - (to - from));
  out.set(b.subarray(0, from));
  out.set(b.subarray(to), from);
  return out;
}

/**
 * Pass a pod's stream (`source.read()`, forward.js Pace) to the client as it asked for it
 * (`want`: {usage, continuous}), counting in `tally`; call `done(usage | null)` once, when it
 * ends or is cut (the client left, the pod broke, or past `cap` bytes: cut there with
 * usage.js `streamCut`): the usage known by then (`tally.usage()`; null when the pod reported
 * none, its generated text's characters then in `tally.chars`). `piped` settles then. When the
 * pod's stream breaks, `onBreak(err)` gives the bytes that end the client's stream (an error
 * event a client's SDK raises), or null to fail it (its client is gone).
 *
 * The client's body is a pull stream (highWaterMark 0): the runtime asks for a chunk when the
 * client can take one, and each pull reads the pod's next chunk, cuts it and hands it over,
 * one JavaScript turn per chunk, as the stall watch already takes; no tee, no writes to
 * await. A client that stops reading stops the pulls; one that leaves cancels the stream,
 * which cancels the pod's. Only a chunk that ends mid-event waits for the rest of its event.
 */
export function pumpPod(source, want, tally, cap, done, onBreak = null) {
  let carry = null; // the start of an event whose end has not arrived yet
  let read = 0;
  let finished = false;
  let settle;
  const piped = new Promise((resolve) => { settle = resolve; });
  const finish = () => {
    if (finished) return;
    finished = true;
    settle(done(tally.usage()));
  };
  const counted = (b) => {
    const out = clientEvents(b, want, tally);
    if (tally.events === 0) tally.chars += contentChars(decoder.decode(b));
    return out;
  };
  const body = new ReadableStream({
    async pull(c) {
      try {
        for (;;) {
          const { done: end, value } = await source.read();
          if (end) {
            const out = carry === null ? null : counted(carry);
            carry = null;
            if (out !== null) c.enqueue(out);
            c.close();
            finish();
            return;
          }
          read += value.byteLength;
          if (read > cap) {
            // Past what the request can produce: the rest is never read, the client is told.
            await source.cancel(new Error("stream_too_large")).catch(() => {});
            c.enqueue(streamCut(cap));
            c.close();
            finish();
            return;
          }
          let b = value;
          if (carry !== null) {
            b = new Uint8Array(carry.byteLength + value.byteLength);
            b.set(carry);
            b.set(value, carry.byteLength);
            carry = null;
          }
          const whole = wholeEvents(b);
          if (whole < b.length) {
            carry = b.slice(whole);
            b = b.subarray(0, whole);
          }
          if (b.byteLength === 0) continue;
          const out = counted(b);
          if (out !== null) {
            c.enqueue(out);
            return;
          }
        }
      } catch (err) {
        // The pod's stream broke (or was cancelled for a hang-up): the client's ends with it,
        // told why where it is still there; what the pod reported by then is counted.
        const last = onBreak === null ? null : onBreak(err);
        if (last === null) c.error(err);
        else {
          c.enqueue(last);
          c.close();
        }
        finish();
      }
    },
    cancel(reason) {
      // The client went away: the pod's request is cancelled, so it is not left generating for nobody.
      finish();
      return source.cancel(reason).catch(() => {});
    },
  }, { highWaterMark: 0 });
  return { body, piped };
}
