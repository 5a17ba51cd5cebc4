// @ts-check
// The front door's ranking: {colo: [cell index, ...]}, nearest cell first. The fleet's plan
// (colocate/fleet/plan.py, rank_module) uploads its own cellrank.js in place of this one, which
// ranks no colo (every request then takes the configured order). A module, not a binding:
// the table outgrows Cloudflare's 5 KB per environment variable past four cells.
export default {};
