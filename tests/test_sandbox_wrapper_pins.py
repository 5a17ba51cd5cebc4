"""The sandbox's entry module (colocate/sandbox/js/wrapper.js) never has one request await a
promise another request made. workerd refuses that once the maker ended
(handle_cross_request_promise_resolution): "This promise was created by a request that has since
ended". The wrapper kept each generation's pin look-up as a shared promise, so a first caller that
hung up while its look-up was pending (a client gone, under load) left every later call of that
isolate failing: a demo-spot day saw one cell answer 503 state_unavailable and 500 for the rest
of its day. Here, in Node with the product module replaced by a probe: callers that arrive while
a look-up is pending each make their own, and the answer, once known, is kept as plain data."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PRODUCT = """
export default {
  async fetch(request, env) {
    return env.BREAKER.get(env.BREAKER.idFromName("g1")).sync(new URL(request.url).pathname);
  },
};
export class Breaker {}
"""

DRIVER = """
import wrapper from "./wrapper.js";
let asked = 0;
const release = [];
const env = {
  __SANDBOX_EDGE_SITE: "NRT",
  __SANDBOX_CONTROL: {
    fetch: () => {
      asked += 1;
      // the first look-up hangs until released (its caller gone); the others answer at once
      return new Promise((resolve) => {
        const answer = () => resolve(new Response(JSON.stringify({ site: "NRT", rtt_ms: 0 })));
        if (asked === 1) release.push(answer); else answer();
      });
    },
  },
  __SANDBOX_NS_NRT: { idFromName: (n) => n, get: (id) => ({ sync: async (who) => `${id} for ${who}` }) },
};
const first = wrapper.fetch(new Request("http://x/first"), env, {}); // its look-up never answers while it waits
const second = await Promise.race([wrapper.fetch(new Request("http://x/second"), env, {}),
  new Promise((resolve) => setTimeout(() => resolve("waited on the first caller's look-up"), 2000))]);
const askedThen = asked;
release.forEach((f) => f());
await first;
const third = await wrapper.fetch(new Request("http://x/third"), env, {});
console.log(JSON.stringify({ second, third, askedThen, askedAfter: asked }));
"""


def test_a_caller_never_waits_on_another_callers_pin_look_up_and_a_known_pin_is_kept(tmp_path):
    shutil.copy(ROOT / "colocate" / "sandbox" / "js" / "wrapper.js", tmp_path / "wrapper.js")
    (tmp_path / "index.js").write_text(PRODUCT)
    (tmp_path / "driver.mjs").write_text(DRIVER)
    (tmp_path / "package.json").write_text('{"type": "module"}')
    r = subprocess.run(["node", "driver.mjs"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["second"] == "g1 for /second" and out["askedThen"] == 2  # its own look-up, not the first's promise
    assert out["third"] == "g1 for /third" and out["askedAfter"] == 2  # the pin, once known, is asked no more
