// @ts-check
// The fleet's front door Worker: the main module. The request handling is front.js; the
// limits exchange's Durable Object is fleetledger.js (exported here, as index.js exports
// the cell's Breaker, so front.js stays importable without the runtime). See docs/fleet.md.

export { FleetLedger } from "./fleetledger.js";
export { default } from "./front.js";
