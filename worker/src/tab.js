// @ts-check
// A request's tab: what it has cost so far, settled once, whoever ends it.
//
// A request is metered, and its max_parallel slot and token reservation released, exactly
// once: when its answer ends, when it is cut, or when its client hangs up. On Cloudflare's
// edge (and in workerd) a client's disconnect cancels the request's own promise and its
// subrequests, so nothing after the `await` it was waiting on ever runs; the disconnect also
// fires the request's abort signal (compatibility flag `enable_request_signal`, colocate/cell/plan.py
// WORKER_COMPATIBILITY_FLAGS), and the tab settles from there: the upstream's work is
// cancelled, what it made is metered (its usage so far: podstream.js Tally; where nothing is
// known, the request's ceiling) and the slot freed, at once (docs/worker.md, "Every token,
// whoever hangs up").

import { Tally } from "./podstream.js";

// A stream already handed to the client is settled by its own pump once its upstream is
// cancelled (the pump's read fails); should it not have settled this long after the
// hang-up, the tab settles with what is known.
export const HANG_UP_GRACE_MS = 1000;

export class Tab {
  /**
   * @param {(backend: string | null, usage: any) => void} onSettle  meters the request and frees
   *   its slot (router.js); a null backend: no upstream was asked, only the slot is freed
   * @param {{prompt: number, completion: number} | null} ceiling  the most the request can cost
   * @param {number} choices  its n (or best_of), for a Tally
   * @param {number} prompts  its prompt count, for a Tally
   */
  constructor(onSettle, ceiling, choices = 1, prompts = 1) {
    this.onSettle = onSettle;
    this.ceiling = ceiling;
    this.choices = choices;
    this.prompts = prompts;
    /** @type {string | null} */
    this.backend = null; // the upstream asked last
    /** @type {{prompt: number, completion: number} | null} */
    this.askCeiling = ceiling; // and the most it is believed up to
    /** @type {(() => void) | null} */
    this.cancel = null; // stops that upstream's work
    /** @type {Tally | null} */
    this.tally = null; // what it has reported so far
    this.pace = null; // an assembled answer's reader (forward.js Pace): what it has not read yet is estimated
    this.pumping = false; // the client's stream has left: its pump settles the tab
    this.settled = false;
    this.hungUp = false;
  }

  /** The request's body is read: its ceiling, its n (or best_of) and its prompt count. */
  know(ceiling, choices = 1, prompts = 1) {
    this.ceiling = ceiling;
    this.askCeiling = ceiling;
    this.choices = choices;
    this.prompts = prompts;
  }

  /** Meter the request once (later calls do nothing). */
  settle(backend, usage) {
    if (this.settled) return;
    this.settled = true;
    this.onSettle(backend, usage);
  }

  /** `backend` is being asked (its `ceiling` when not the request's): a fresh tally of what it makes. */
  ask(backend, ceiling = this.ceiling) {
    this.backend = backend;
    this.askCeiling = ceiling;
    this.cancel = null;
    this.pace = null;
    this.tally = new Tally(this.choices, this.prompts);
    return this.tally;
  }

  /** Settle on the client's hang-up (the request's abort signal), cancelling the upstream's work. */
  hangUp(ctx) {
    if (this.settled || this.hungUp) return;
    this.hungUp = true;
    if (this.cancel !== null) this.cancel();
    if (this.pumping) {
      // Its pump sees the cancelled read and settles with what the pod reported by then.
      ctx.waitUntil(new Promise((resolve) => setTimeout(resolve, HANG_UP_GRACE_MS)).then(() => this.settle(this.backend, this.known())));
      return;
    }
    this.settle(this.backend, this.backend === null ? null : this.known());
  }

  /**
   * What the upstream asked last has made, as far as the router knows: its usage so far, plus,
   * for an answer being assembled, the events that arrived since its last read at the pace
   * read so far (forward.js Pace.unread), in tokens at the answer's tokens per event so far;
   * where it reported nothing, the ceiling.
   */
  known() {
    const u = this.tally === null ? null : this.tally.usage();
    const ceiling = this.askCeiling;
    if (u === null) return ceiling === null ? null : { prompt: ceiling.prompt, completion: ceiling.completion, estimated: true };
    const unread = this.pace === null ? 0 : this.pace.unread(Date.now());
    if (unread <= 0) return u;
    // events to tokens at the answer's own ratio so far (a server may put several tokens in an event)
    const perEvent = Math.max(1, u.completion / Math.max(1, this.pace.events - 1));
    return { prompt: u.prompt, completion: u.completion + Math.round(unread * perEvent), estimated: true };
  }
}

/**
 * A tab for `request`, settled by `onSettle`; on the client's hang-up (the request's abort
 * signal) it settles from there, the work in `ctx.waitUntil`.
 * @param {Request} request
 * @param {{waitUntil(p: Promise<unknown>): void}} ctx
 */
export function openTab(request, ctx, onSettle, ceiling, choices = 1, prompts = 1) {
  const tab = new Tab(onSettle, ceiling, choices, prompts);
  const signal = request.signal;
  if (signal) signal.addEventListener("abort", () => tab.hangUp(ctx), { once: true });
  return tab;
}
