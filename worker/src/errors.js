// @ts-check
// JSON errors for clients, and redaction for log lines.
//
// Every error a client sees is OpenAI's shape, {"error": {"message", "type", "code"}},
// with the right status, so OpenAI SDKs raise their matching exception
// (AuthenticationError, RateLimitError, ...). Nothing here ever includes a stack trace
// or a binding value.

/** OpenAI's error `type` for a status (as api.openai.com answers; 429s name their own:
 * requests, tokens, insufficient_quota). */
export function errorType(status) {
  if (status === 429) return "requests";
  if (status >= 500) return "server_error";
  return "invalid_request_error";
}

/** An error the router answers with a JSON body; `status`, `code` and `type` go to the client. */
export class HttpError extends Error {
  constructor(status, code, message, headers = {}, type = errorType(status), param = undefined) {
    super(message);
    this.param = param; // the request field at fault (validate.js); OpenAI's `param`
    this.name = "HttpError";
    this.status = status;
    this.code = code;
    this.headers = headers;
    this.type = type;
    /** @type {number | undefined} ms the router holds a repeated refusal before answering */
    this.holdMs = undefined;
    /** @type {{keyId: string, t: number} | undefined} a refusal by a fleet cell's lease alone (router.js) */
    this.elsewhere = undefined;
    /** @type {string | undefined} a key's 429: why (refusals.js REASONS), counted per key */
    this.reason = undefined;
  }
}

/** Raised when a binding holds a value the Worker cannot use (names the binding). */
export class ConfigurationError extends Error {
  constructor(binding, problem) {
    super(`binding ${binding}: ${problem}`);
    this.name = "ConfigurationError";
    this.binding = binding;
  }
}

export function jsonResponse(status, body, headers = {}) {
  return new Response(JSON.stringify(body), {
    status,
    headers: { "content-type": "application/json", ...headers },
  });
}

export function errorResponse(status, code, message, headers = {}, type = errorType(status), param = undefined) {
  const error = param === undefined ? { message, type, code } : { message, type, param, code };
  return jsonResponse(status, { error }, headers);
}

// Bindings whose values must never reach a log line or a response.
export const SECRET_BINDINGS = ["POD_TOKEN", "FALLBACK_URL", "FALLBACK_API_KEY", "PROBE_TOKEN", "READ_TOKEN", "ADMIN_TOKEN",
  "EXCHANGE_TOKEN"];

const CELL_TOKEN = /^CELL_TOKEN_\d+$/; // a fleet's front door holds each cell's exchange token

/** `text` with every secret binding value replaced by [redacted]. */
export function redact(text, env) {
  let out = String(text);
  const names = env ? [...SECRET_BINDINGS, ...Object.keys(env).filter((k) => CELL_TOKEN.test(k))] : SECRET_BINDINGS;
  for (const name of names) {
    const value = env && env[name];
    if (typeof value === "string" && value.length > 0) out = out.split(value).join("[redacted]");
  }
  return out;
}

/** One log line, redacted: the only way this Worker writes to the console. */
export function log(env, event, fields = {}) {
  console.log(redact(JSON.stringify({ event, ...fields }), env));
}
