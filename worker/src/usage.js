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

// After `"usage"`: blanks, the colon, and the object's opening brace (anything else, such
// as null, is not a usage object).
const USAGE_OPEN = /[ \t\r\n]*:[ \t\r\n]*\{/y;

/**
 * Usage of a complete JSON answer's bytes, or null. Only the `"usage": {...}` object is
 * parsed, not the whole answer; the search is the runtime's own (decode, lastIndexOf,
 * indexOf), not a loop over bytes in JavaScript, which costs more per request than the
 * text it skips. Answers put `usage` near their end, so the last TAIL_BYTES are searched
 * first and a long answer is decoded whole only when its usage is not among them.
 */
export function usageOfJson(buffer) {
  const bytes = buffer instanceof Uint8Array ? buffer : new Uint8Array(buffer);
  if (bytes.length > TAIL_BYTES) {
    // The last match in a suffix is the last match in the whole (a match that straddles
    // the cut starts earlier), and a usage object closes before the end.
    const found = usageOfText(decoder.decode(bytes.subarray(bytes.length - TAIL_BYTES)));
    if (found !== undefined) return found;
  }
  return usageOfText(decoder.decode(bytes)) ?? null;
}

/** usageOfJson on text: undefined when the text has no `"usage"` at all. */
function usageOfText(text) {
  const at = text.lastIndexOf('"usage"');
  if (at < 0) return undefined;
  USAGE_OPEN.lastIndex = at + 7;
  if (!USAGE_OPEN.test(text)) return null;
  const start = USAGE_OPEN.lastIndex - 1;
  // The matching brace: usage objects nest (prompt_tokens_details: {...}).
  let depth = 0;
  for (let i = start; ;) {
    const open = text.indexOf("{", i);
    const close = text.indexOf("}", i);
    if (close < 0) return null;
    if (open >= 0 && open < close) {
      depth++;
      i = open + 1;
    } else if (--depth === 0) {
      try {
        return fromUsage(JSON.parse(text.slice(start, close + 1)));
      } catch {
        return null;
      }
    } else {
      i = close + 1;
    }
  }
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
