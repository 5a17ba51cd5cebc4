// @ts-check
// Request bodies: bounded reading and JSON parsing.

import { HttpError } from "./errors.js";

const decoder = new TextDecoder(); // stateless between decode() calls: one per isolate

function tooLarge(limit) {
  return new HttpError(413, "payload_too_large", `request body is larger than MAX_BODY_BYTES (${limit} bytes)`);
}

function tooSlow(ms) {
  return new HttpError(408, "request_timeout", `the request body did not arrive within ${ms} ms of its headers (BODY_TIMEOUT_MS, `
    + "colocate:worker.bodyTimeoutMs): send it at once, or a smaller one");
}

/**
 * The whole body as bytes, refusing more than `limit`: by Content-Length before
 * reading, and by counting while reading when it is absent (chunked uploads). A body not
 * all there within `timeoutMs` is refused (408): a slow upload holds its key's slot and the
 * isolate's memory, so it is bounded in time as well as size.
 */
export async function readBody(request, limit, timeoutMs = 0) {
  const declared = request.headers.get("content-length");
  let n = -1;
  if (declared !== null) {
    n = Number(declared);
    if (!Number.isInteger(n) || n < 0) throw new HttpError(400, "invalid_content_length", "Content-Length is not a whole number");
    if (n > limit) throw tooLarge(limit);
  }
  if (!request.body) return new Uint8Array(0);
  let timer = null;
  let reader = null;
  // The runtime enforces a declared length, so the native read is safe and cheaper.
  const reading = n >= 0 ? request.arrayBuffer().then((b) => new Uint8Array(b)) : readUpTo(request.body, limit, (r) => { reader = r; });
  if (!(timeoutMs > 0)) return bodyOrTooLarge(await reading, limit);
  const late = new Promise((_resolve, reject) => {
    timer = setTimeout(() => {
      if (reader !== null) reader.cancel().catch(() => {});
      reject(tooSlow(timeoutMs));
    }, timeoutMs);
  });
  reading.catch(() => {}); // a read cut by the timeout fails after the answer has gone
  try {
    return bodyOrTooLarge(await Promise.race([reading, late]), limit);
  } finally {
    clearTimeout(timer);
  }
}

function bodyOrTooLarge(body, limit) {
  if (body === null) throw tooLarge(limit);
  return body;
}

/**
 * A stream's bytes in one array, counted while read: null (and the stream cancelled) once
 * they pass `cap`. For bodies whose length is not declared, where only counting bounds them.
 * @param {ReadableStream<Uint8Array>} stream
 * @param {number} cap
 * @param {((reader: ReadableStreamDefaultReader<Uint8Array>) => void) | null} [onReader]  told the reader (to cancel it)
 * @returns {Promise<Uint8Array | null>}
 */
export async function readUpTo(stream, cap, onReader = null) {
  const reader = stream.getReader();
  if (onReader) onReader(reader);
  const chunks = [];
  let size = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    size += value.byteLength;
    if (size > cap) {
      await reader.cancel().catch(() => {});
      return null;
    }
    chunks.push(value);
  }
  return concat(chunks, size);
}

/** `chunks` joined into one array of `size` bytes. */
export function concat(chunks, size) {
  const out = new Uint8Array(size);
  let at = 0;
  for (const c of chunks) {
    out.set(c, at);
    at += c.byteLength;
  }
  return out;
}

/** Parse bytes as a JSON object; 400 `invalid_json` otherwise. */
export function parseJsonObject(bytes) {
  let value;
  try {
    value = JSON.parse(decoder.decode(bytes));
  } catch {
    throw new HttpError(400, "invalid_json", "request body is not valid JSON");
  }
  if (value === null || typeof value !== "object" || Array.isArray(value)) {
    throw new HttpError(400, "invalid_json", "request body must be a JSON object");
  }
  return value;
}
