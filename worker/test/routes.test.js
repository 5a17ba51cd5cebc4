// The router's dispatch reads a request's path and query from its URL string (routes.js
// pathAndQuery): the same two parts a URL object gives, for every shape a request URL takes.
import test from "node:test";
import assert from "node:assert/strict";

import { pathAndQuery } from "../src/routes.js";

test("pathAndQuery cuts the path and query exactly as URL parses them", () => {
  const urls = [
    "http://127.0.0.1:8787/v1/chat/completions",
    "https://router.example.workers.dev/v1/chat/completions?x=1&y=%20z",
    "http://h/v1/models?",
    "http://h/",
    "http://h",
    "http://h?only=pods",
    "http://user:pw@h:1/_colocate/keys/key_ab12/revoke?a=/b?c",
    "http://h/v1/chat%2Fcompletions?q=%3F#frag",
    "http://h/a#b?c",
    "http://h//double//slashes/?",
    "http://[::1]:9/_colocate/probe?only=pods",
  ];
  for (const raw of urls) {
    const href = new URL(raw).href; // serialized, as the runtime hands request.url to a Worker
    const u = new URL(href);
    assert.deepEqual(pathAndQuery(href), { pathname: u.pathname, search: u.search }, raw);
  }
});
