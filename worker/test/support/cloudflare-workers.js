// What generation.js takes from the "cloudflare:workers" module, for Node: the base class
// keeps ctx and env as workerd's does. Loaded through hooks.mjs; workerd needs none of it.
export class DurableObject {
  constructor(ctx, env) {
    this.ctx = ctx;
    this.env = env;
  }
}
