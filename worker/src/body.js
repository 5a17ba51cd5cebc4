// @ts-check
// Request bodies: bounded reading and JSON parsing.

import { HttpError } from "./errors.js";

const decoder = new TextDecoder(); // stateless between decode() calls: one per isolate

function tooLarge(limit) {
  return new HttpError(413, "payload_too_large", `request body is larger than MAX_BODY_BYTES (${limit} bytes)`);
}

/**
 * The whole body as bytes, refusing more than `limit`: by Content-Length before
 * reading, and by counting while reading when it is absent (chunked uploads).
 */
export async function readBody(request, limit) {
  const declared = request.headers.get("content-length");
  if (declared !== null) {
    const n = Number(declared);
    if (!Number.isInteger(n) || n < 0) throw new HttpError(400, "invalid_content_length", "Content-Length is not a whole number");
    if (n > limit) throw tooLarge(limit);
    // The runtime enforces the declared length, so the native read is safe and cheaper.
    return new Uint8Array(await request.arrayBuffer());
  }
  if (!request.body) return new Uint8Array(0);
  const body = await readUpTo(request.body, limit);
  if (body === null) throw tooLarge(limit);
  return body;
}

/**
 * A stream's bytes in one array, counted while read: null (and the stream cancelled) once
 * they pass `cap`. For bodies whose length is not declared, where only counting bounds them.
 * @param {ReadableStream<Uint8Array>} stream
 * @param {number} cap
 * @returns {Promise<Uint8Array | null>}
 */
export async function readUpTo(stream, cap) {
  const reader = stream.getReader();
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
