// Token usage from upstream answers (OpenAI's `usage` object), for limits and usage rows.
//
// A complete JSON answer carries `usage` at its top level. A streamed (SSE) answer carries
// it in its last data event when the client asked `stream_options.include_usage` (vLLM and
// OpenAI both do so); other streams count as requests with unknown tokens
// (docs/worker.md says what that means for token limits).

const decoder = new TextDecoder();
const TAIL_BYTES = 16384; // the last events of a stream; a usage event is a few hundred bytes

/** {prompt, completion} from a usage object, or null. */
function fromUsage(u) {
  if (!u || typeof u !== "object") return null;
  const prompt = Number.isInteger(u.prompt_tokens) && u.prompt_tokens > 0 ? u.prompt_tokens : 0;
  const completion = Number.isInteger(u.completion_tokens) && u.completion_tokens > 0 ? u.completion_tokens : 0;
  return prompt + completion > 0 ? { prompt, completion } : null;
}

const USAGE = new TextEncoder().encode('"usage"');
const OPEN = 123; // {
const CLOSE = 125; // }

/** The last index of `needle` in `bytes`, or -1 (answers put `usage` near their end). */
function lastIndexOf(bytes, needle) {
  outer: for (let i = bytes.length - needle.length; i >= 0; i--) {
    for (let j = 0; j < needle.length; j++) if (bytes[i + j] !== needle[j]) continue outer;
    return i;
  }
  return -1;
}

/**
 * Usage of a complete JSON answer's bytes, or null. Only the `"usage": {...}` object is
 * decoded and parsed, not the whole answer: the hot path stays free of a full parse.
 */
export function usageOfJson(buffer) {
  const bytes = buffer instanceof Uint8Array ? buffer : new Uint8Array(buffer);
  const at = lastIndexOf(bytes, USAGE);
  if (at < 0) return null;
  let start = -1;
  let depth = 0;
  for (let i = at + USAGE.length; i < bytes.length; i++) {
    const b = bytes[i];
    if (b === OPEN) {
      if (depth++ === 0) start = i;
    } else if (b === CLOSE && depth > 0 && --depth === 0) {
      try {
        return fromUsage(JSON.parse(decoder.decode(bytes.subarray(start, i + 1))));
      } catch {
        return null;
      }
    } else if (depth === 0 && b !== 32 && b !== 58 && b !== 10 && b !== 13 && b !== 9) {
      return null; // "usage": null, or not an object
    }
  }
  return null;
}

/** Usage in the last SSE data event that has one, or null. */
export function usageOfSseTail(text) {
  const lines = text.split("\n");
  for (let i = lines.length - 1; i >= 0; i--) {
    const line = lines[i];
    if (!line.startsWith("data:") || line.indexOf('"usage"') < 0) continue;
    try {
      const u = fromUsage(JSON.parse(line.slice(5)).usage);
      if (u) return u;
    } catch {
      // a cut-off event at the start of the tail: keep looking further up
    }
  }
  return null;
}

/**
 * Pass a stream through unchanged and call `done(usage | null)` once when it ends or is
 * cancelled. With `wantUsage` false no bytes are kept (nothing to parse).
 */
export function tapStream(body, wantUsage, done) {
  let tail = wantUsage ? new Uint8Array(0) : null;
  let called = false;
  const finish = (usage) => {
    if (!called) {
      called = true;
      done(usage);
    }
  };
  const ts = new TransformStream({
    transform(chunk, controller) {
      controller.enqueue(chunk);
      if (tail) {
        const keep = Math.min(TAIL_BYTES, tail.byteLength + chunk.byteLength);
        const next = new Uint8Array(keep);
        const fromChunk = Math.min(chunk.byteLength, keep);
        const fromTail = keep - fromChunk;
        next.set(tail.subarray(tail.byteLength - fromTail), 0);
        next.set(chunk.subarray(chunk.byteLength - fromChunk), fromTail);
        tail = next;
      }
    },
    flush() {
      finish(tail ? usageOfSseTail(decoder.decode(tail)) : null);
    },
    cancel() {
      finish(null);
    },
  });
  const piped = body.pipeTo(ts.writable).catch(() => finish(null));
  return { body: ts.readable, piped };
}
