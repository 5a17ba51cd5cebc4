// The byte scan that finds a stream's usage object without decoding each chunk
// (usage.js hasUsageObject) says what the regular expression on the decoded text says.
import { test } from "node:test";
import assert from "node:assert/strict";
import { hasUsageObject } from "../src/usage.js";

const USAGE_OBJECT = /"usage"[ \t\r\n]*:[ \t\r\n]*\{/;
const enc = new TextEncoder();

test("the byte scan agrees with the regular expression on events real and made up", () => {
  const cases = [
    'data: {"id":"x","choices":[],"usage":{"prompt_tokens":1}}\n\n',
    'data: {"id":"x","choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n',
    'data: {"usage" :\t{"a":1}}\n\n',
    'data: {"usage"\r\n:\n {"a":1}}\n\n',
    'data: {"choices":[{"delta":{"content":"the \\"usage\\":{ field"}}]}\n\n', // escaped quotes: not the key
    'data: {"xusage":{"a":1}}\n\n',
    'data: {"usage":[{"a":1}]}\n\n',
    '{"usage":{', '"usage":{', 'usage":{', ':{', '{', '', '"usage": "{"',
  ];
  // and random strings over the alphabet that matters
  const alphabet = ['"', "u", "s", "a", "g", "e", ":", "{", " ", "\n", "x", "\\"];
  let seed = 7;
  const rnd = () => (seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648;
  for (let i = 0; i < 5000; i++) {
    let s = "";
    const n = Math.floor(rnd() * 24);
    for (let j = 0; j < n; j++) s += rnd() < 0.3 ? '"usage"' : alphabet[Math.floor(rnd() * alphabet.length)];
    cases.push(s);
  }
  for (const c of cases) assert.equal(hasUsageObject(enc.encode(c)), USAGE_OBJECT.test(c), JSON.stringify(c));
});
