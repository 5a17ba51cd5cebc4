// A client key created in a generation object, as the admin endpoint creates one (the tests' own).
import { keyHash, newKey } from "../../src/keys.js";

/** A new key in generation `gen` of namespace `ns`, unlimited unless `limits` says: {key, id}. */
export async function createKey(ns, gen, limits = {}) {
  const key = newKey();
  const object = await ns.instance(gen);
  const id = `key_${(await object.listKeys({ generation: gen })).length}`;
  await object.createKey({ id, hash: await keyHash(key), prefix: key.slice(0, 12), name: "t", rpm: 0, tpm: 0, monthly_tokens: 0,
    max_parallel: 0, created_at: Date.now(), expires_at: null, ...limits }, { generation: gen });
  return { key, id };
}

/** The same, the key alone. */
export async function withKey(ns, gen, limits = {}) {
  return (await createKey(ns, gen, limits)).key;
}
