// Node module hooks: "cloudflare:workers" resolves to the stand-in beside this file, so the
// Worker's own modules load in Node unchanged (registered by objects.js).
const STAND_IN = new URL("./cloudflare-workers.js", import.meta.url).href;

export async function resolve(specifier, context, next) {
  if (specifier === "cloudflare:workers") return { url: STAND_IN, shortCircuit: true };
  return next(specifier, context);
}
