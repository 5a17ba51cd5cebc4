"""Run the real Pulumi program under the SDK's mock engine (no CLI) and record what it declares."""

from __future__ import annotations

import asyncio
import gc
import json
from dataclasses import dataclass, field

import pulumi

from colocate import stackfile

SECRET_VALUES = {
    "podToken": "pod-token-s3cret",
    "readToken": "read-token-s3cret",
    "adminToken": "admin-token-s3cret",
    "exchangeToken": "exchange-token-s3cret",
    "fallbackUrl": "https://fallback.example.com",
    "fallbackApiKey": "fallback-key-s3cret",
    "runpodApiKey": "runpod-key-s3cret",
    "vastaiApiKey": "vastai-key-s3cret",
}
POD_STDOUT = {"id": "pod-123", "provider": "runpod", "location": "AP-JP-1", "url": "http://203.0.113.7:41234",
              "cost_per_hr": 0.69, "gpu": "NVIDIA GeForce RTX 4090", "name": "x", "ip": "203.0.113.7", "port": 41234}
PROBE_STDOUT = {"ok": True, "verdict": "all checks hold"}


SCRIPTS_INVOKE = "cloudflare:index/getWorkersScripts:getWorkersScripts"
ZONES_INVOKE = "cloudflare:index/getZones:getZones"
# The zones the mock account has: the id the tests use and stacks/Pulumi.apac-tw.yaml's placeholder.
ZONES = {"f" * 32: "example.com", "0" * 32: "example.com"}


def pod_stdout(spec: dict) -> dict:
    """What `pod.py create` prints for a spec: pod 0 is POD_STDOUT, pod i gets its own id,
    address and its preferred location (the first of the spec's list)."""
    if spec.get("provider") == "existing":  # the team's box: everything pod.py prints is declared
        from colocate.pods import existing
        from colocate.pods.spec import PodSpec

        return existing.result(PodSpec.from_dict(spec))
    i = spec.get("index", 0)
    if i == 0:
        return dict(POD_STDOUT)
    ip = f"203.0.113.{7 + i}"
    return {**POD_STDOUT, "id": f"pod-123-{i}", "location": spec["locations"][0], "ip": ip,
            "url": f"http://{ip}:{41234 + i}", "port": 41234 + i}


WORKERS_SCRIPT = "cloudflare:index/workersScript:WorkersScript"


def mock_pem(kind: str, name: str) -> str:
    """A PEM-shaped stand-in naming the resource it came from (the mocks sign nothing)."""
    return f"-----BEGIN {kind}-----\n{name}\n-----END {kind}-----\n"


MOCK_NOT_AFTER = "2027-03-06T06:00:00Z"  # what pulumi-tls computes from validity_period_hours at create


def tls_outputs(typ: str, name: str) -> dict:
    """What pulumi-tls's resources compute: keys, a request, certificates, each naming its resource."""
    if typ == "tls:index/privateKey:PrivateKey":
        return {"privateKeyPem": mock_pem("EC PRIVATE KEY", name), "privateKeyPemPkcs8": mock_pem("PRIVATE KEY", name),
                "publicKeyPem": mock_pem("PUBLIC KEY", name)}
    if typ == "tls:index/certRequest:CertRequest":
        return {"certRequestPem": mock_pem("CERTIFICATE REQUEST", name)}
    if typ in ("tls:index/selfSignedCert:SelfSignedCert", "tls:index/locallySignedCert:LocallySignedCert"):
        return {"certPem": mock_pem("CERTIFICATE", name), "validityEndTime": MOCK_NOT_AFTER}
    if typ == ACME_CERTIFICATE:  # pulumiverse-acme: the leaf, its issuer's chain, and when it ends
        return {"certificatePem": mock_pem("CERTIFICATE", name), "issuerPem": mock_pem("CERTIFICATE", f"{name} issuer"),
                "certificateNotAfter": MOCK_NOT_AFTER, "certificateDomain": name}
    if typ == ACME_REGISTRATION:
        return {"registrationUrl": f"https://acme.example/acct/{name}"}
    return {}


ACME_CERTIFICATE = "acme:index/certificate:Certificate"
ACME_REGISTRATION = "acme:index/registration:Registration"


class UndeletableScript(Exception):
    """A script `pulumi destroy` could not delete: what Cloudflare answers such a delete."""


def refuse_undeletable(name: str, inputs: dict) -> None:
    """Cloudflare deletes a script that implements a Durable Object class, or that another
    Worker binds, only when the delete is forced (cloudflare-go ``ScriptDeleteParams.Force``;
    pulumi-cloudflare 6.23.1 ``WorkersScriptArgs.force``). The mocks cannot run a destroy, so
    they refuse the declaration whose destroy Cloudflare would refuse. Every script of this
    kit implements a class (the cell's Breaker, the front door's FleetLedger) and a cell's
    is bound by its fleet's front door."""
    bindings = inputs.get("bindings") or []
    if isinstance(bindings, dict):  # a secret list arrives wrapped
        bindings = bindings.get("value") or []
    own = [b.get("className") for b in bindings
           if b.get("type") == "durable_object_namespace" and not b.get("scriptName")]
    if own and inputs.get("force") is not True:
        raise UndeletableScript(f"{name}: Cloudflare would refuse to delete this script: it implements the Durable "
                                f"Object class {own[0]} and the delete is not forced (force=True)")


class OverLimit(Exception):
    """An upload Cloudflare refuses for its size: what the upload API answers."""


def refuse_over_limits(name: str, inputs: dict) -> None:
    """Cloudflare's published limits on an upload (developers.cloudflare.com/workers/platform/limits,
    the numbers colocate/cell/cloudflare_limits.py holds): an environment variable (plain text,
    json, secret) over 5 KB, or more than 64 of them (Workers Free)."""
    from colocate.cell import cloudflare_limits

    bindings = inputs.get("bindings") or []
    if isinstance(bindings, dict):
        bindings = bindings.get("value") or []
    variables = [b for b in bindings if b.get("type") in cloudflare_limits.ENV_VAR_TYPES]
    for b in variables:
        value = b.get("text") if b.get("text") is not None else b.get("json")
        if isinstance(value, str) and len(value.encode()) > cloudflare_limits.ENV_VAR_BYTES:
            raise OverLimit(f"{name}: binding {b['name']} is {len(value.encode())} bytes; Cloudflare refuses an "
                            f"environment variable over {cloudflare_limits.ENV_VAR_BYTES} bytes")
    if len(variables) > cloudflare_limits.ENV_VARS:
        raise OverLimit(f"{name}: {len(variables)} environment variables; Cloudflare allows {cloudflare_limits.ENV_VARS}")


class RecordingMocks(pulumi.runtime.Mocks):
    """Records every declared resource and invoke. ``scripts`` is the account's Workers
    scripts as Cloudflare lists them ({name: migration tag}); None makes the list fail."""

    def __init__(self, scripts: dict[str, str] | None = None) -> None:
        self.resources: list[pulumi.runtime.MockResourceArgs] = []
        self.calls: list[pulumi.runtime.MockCallArgs] = []
        self.scripts = {} if scripts is None else scripts
        self.scripts_fail = False
        self.zones = dict(ZONES)  # {zone id: name}: what listing the account's zones finds

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        self.resources.append(args)
        if args.typ == WORKERS_SCRIPT:
            refuse_undeletable(args.name, args.inputs)
            refuse_over_limits(args.name, args.inputs)
        outs = dict(args.inputs)
        outs.update(tls_outputs(args.typ, args.name))
        if args.typ == "command:local:Command":
            create = outs.get("create", "")
            if "pod.py create" in create or "pod.py wait" in create:
                outs["stdout"] = json.dumps(pod_stdout(json.loads(outs["stdin"])))
            elif "pod.py rent" in create:  # the pod's id and name, before anything waits on it
                spec = json.loads(outs["stdin"])
                made = pod_stdout(spec)
                outs["stdout"] = json.dumps({"id": made["id"], "provider": made["provider"], "name": spec["name"]})
            elif "probe.py" in create:
                outs["stdout"] = json.dumps(PROBE_STDOUT)
            else:
                outs["stdout"] = ""
        return [f"{args.name}-id", outs]

    def call(self, args: pulumi.runtime.MockCallArgs):
        self.calls.append(args)
        if args.token == SCRIPTS_INVOKE:
            if self.scripts_fail:
                raise RuntimeError("Cloudflare API unreachable")
            return {"accountId": args.args.get("accountId"),
                    "results": [{"id": name, "migrationTag": tag} for name, tag in self.scripts.items()]}
        if args.token == ZONES_INVOKE:  # the name filter is an exact match by default
            name = args.args.get("name")
            return {"results": [{"id": zid, "name": n, "status": "active"} for zid, n in self.zones.items() if n == name]}
        return {}

    def of_type(self, typ: str) -> list[pulumi.runtime.MockResourceArgs]:
        return [r for r in self.resources if r.typ == typ]

    def one(self, typ: str, suffix: str = "") -> pulumi.runtime.MockResourceArgs:
        found = [r for r in self.of_type(typ) if r.name.endswith(suffix)]
        assert len(found) == 1, f"expected one {typ} named *{suffix}, got {[r.name for r in found]}"
        return found[0]


@dataclass
class Run:
    mocks: RecordingMocks
    exports: dict = field(default_factory=dict)
    resolved: dict = field(default_factory=dict)
    secret_flags: dict = field(default_factory=dict)


def stack_config(stack: str, *, overrides: dict | None = None, drop: tuple[str, ...] = (),
                 secrets: dict | None = None, stacks_dir=stackfile.STACKS_DIR) -> tuple[dict, list[str]]:
    """A stack file's config as the CLI would hand it to the program, plus test secrets."""
    raw, _ = stackfile.read_config(stack, stacks_dir)
    raw.setdefault("accountId", "0123456789abcdef0123456789abcdef")
    worker = dict(raw.get("worker") or {})
    worker.setdefault("subdomain", "acme")
    raw["worker"] = worker
    raw.update(overrides or {})
    for key in drop:
        raw.pop(key, None)
    config = {f"colocate:{k}": v if isinstance(v, str) else json.dumps(v) for k, v in raw.items()}
    secret_values = dict(SECRET_VALUES if secrets is None else secrets)
    for k, v in secret_values.items():
        config[f"colocate:{k}"] = v
    config["cloudflare:apiToken"] = "cf-token-s3cret"
    return config, [f"colocate:{k}" for k in secret_values] + ["cloudflare:apiToken"]


_frozen = False


def _freeze_imports() -> None:
    """Move what is alive now (pulumi_cloudflare's thousands of classes, once imported) out of
    the collector's sight: the full collection after a refused program then scans only what
    the runs made, a few ms instead of about 150."""
    global _frozen
    if not _frozen:
        gc.collect()
        gc.freeze()
        _frozen = True


def run_program(stack: str, config: dict, secret_keys: list[str], *, scripts: dict[str, str] | None = None,
                scripts_fail: bool = False, mocks: RecordingMocks | None = None) -> Run:
    """Run infra.program.main() for ``stack`` under mocks; raises what the program raises.
    ``scripts``: the Workers scripts Cloudflare reports ({name: migration tag}; default none)."""
    from infra.program import main

    _freeze_imports()
    mocks = mocks or RecordingMocks(scripts)
    mocks.scripts_fail = mocks.scripts_fail or scripts_fail
    pulumi.runtime.set_all_config(config, secret_keys)
    pulumi.runtime.set_mocks(mocks, project="colocate", stack=stack, preview=False)
    run = Run(mocks)

    @pulumi.runtime.test
    def go():
        run.exports = main()
        names = list(run.exports)
        outs = [pulumi.Output.from_input(run.exports[n]) for n in names]

        async def resolve():
            for name, out in zip(names, outs, strict=True):
                run.secret_flags[name] = await out.is_secret()
                run.resolved[name] = await out.future()

        return asyncio.ensure_future(resolve())

    try:
        go()
    except BaseException:
        # A RunError raised inside an apply (the fleet's checks of its members' outputs)
        # leaves futures whose exception nobody retrieved; asyncio logs them when they are
        # collected. Collect them here: collected later, during a compile, they trip
        # CPython 3.11's "AST constructor recursion depth mismatch" (an INTERNALERROR).
        # Only then: a full collection costs more than the program's whole run.
        gc.collect()
        raise
    return run


SECRET_SIG = pulumi.runtime.rpc._special_secret_sig


def unsecret(value):
    """(is_secret, plain value) of a mock input that may be wrapped as a secret."""
    if isinstance(value, dict) and value.get(pulumi.runtime.rpc._special_sig_key) == SECRET_SIG:
        return True, value["value"]
    return False, value


def plain(value):
    return unsecret(value)[1]


@dataclass
class Declared:
    """A resource as the program constructed it: its object, type, name and resource options (which the
    mock engine does not see: replace_on_changes, delete_before_replace, depends_on)."""

    resource: pulumi.Resource
    typ: str
    name: str
    opts: pulumi.ResourceOptions


def record_options(monkeypatch) -> list[Declared]:
    """Every CustomResource the program constructs from now on, with its options, in construction order."""
    seen: list[Declared] = []
    original = pulumi.CustomResource.__init__

    def spy(self, t, name, props=None, opts=None, *args, **kwargs):
        seen.append(Declared(self, t, name, opts or pulumi.ResourceOptions()))
        return original(self, t, name, props, opts, *args, **kwargs)

    monkeypatch.setattr(pulumi.CustomResource, "__init__", spy)
    return seen
