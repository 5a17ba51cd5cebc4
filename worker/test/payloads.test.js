import { test } from "node:test";
import assert from "node:assert/strict";
import { COUNTER, EXCHANGE, INFLIGHT, LEASE, SHAPES, USAGE, WINDOW } from "../src/payloads.js";
import { badLeases, rowProblem, sumRows } from "../src/fleetexchange.js";
import { minuteOf } from "../src/limits.js";
import { BULK_USAGE, UPSERT_PEERS, USAGE_COLUMNS } from "../src/schema.js";

const T = Date.UTC(2026, 11, 5, 12, 0, 30);
const M = minuteOf(T);

test("every shape names each column once, with its meaning, and indexes it by name", () => {
  for (const [name, columns] of Object.entries(SHAPES)) {
    const names = columns.map(([n]) => n);
    assert.equal(new Set(names).size, names.length, `${name}: a column named twice`);
    for (const [n, meaning] of columns) assert.ok(typeof meaning === "string" && meaning.length > 5, `${name}.${n}: no meaning`);
  }
  for (const shape of [COUNTER, EXCHANGE, LEASE, USAGE, WINDOW, INFLIGHT]) {
    shape.names.forEach((n, i) => assert.equal(shape[n], i));
    assert.equal(shape.zero().length, shape.length);
  }
  assert.deepEqual(EXCHANGE.zero("key_0123456789ab", M), ["key_0123456789ab", M, 0, 0, 0, 0, 0, 0, 0, 0]);
  assert.deepEqual(WINDOW.of({ tokens: 7, key_id: "k", requests: 2, minute: M }), ["k", M, 2, 7]);
});

test("the exchange's writer and reader agree: a summed row is read back by name and passes the push check", () => {
  const cell = EXCHANGE.zero("key_0123456789ab", M);
  cell[EXCHANGE.req] = 3;
  cell[EXCHANGE.tok] = 30;
  cell[EXCHANGE.month] = "2026-12";
  cell[EXCHANGE.month_tokens] = 40;
  cell[EXCHANGE.day] = "";
  const sum = sumRows("key_0123456789ab", [cell, cell], T);
  assert.equal(rowProblem(sum, 0), null);
  assert.deepEqual([sum[EXCHANGE.req], sum[EXCHANGE.tok], sum[EXCHANGE.month_tokens]], [6, 60, 80]);
  // A lease row built by name passes the cell's check; one of another length is refused naming the columns.
  const lease = LEASE.of({ key_id: "key_0123456789ab", req: 3, tok: null, month: "2026-12", month_tokens: 100, day: "", fallback_microusd: null });
  assert.equal(badLeases([lease]), null);
  assert.match(badLeases([lease.slice(0, -1)]), new RegExp(`must be \\[${LEASE.names.join(", ")}\\]`));
});

test("a row written to another shape than the reader's is refused, naming the columns", () => {
  const row = sumRows("key_0123456789ab", [], T);
  assert.match(rowProblem(row.slice(0, -1), 0), new RegExp(`must be \\[${EXCHANGE.names.join(", ")}\\]`));
  assert.match(rowProblem([...row, 0], 0), /field "rows\[0\]" must be \[key_id, minute/);
});

test("the SQL takes its column lists from the shapes", () => {
  assert.equal(USAGE_COLUMNS, USAGE.names.join(", "));
  for (const n of USAGE.names.slice(USAGE.requests)) assert.match(BULK_USAGE, new RegExp(`${n} = ${n} \\+ excluded\\.${n}`));
  assert.match(UPSERT_PEERS, new RegExp(`\\(${EXCHANGE.names.join(", ")}, at\\)`));
});
