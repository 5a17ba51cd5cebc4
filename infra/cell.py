"""The ``Cell`` component: one Worker, one state generation, N GPU pods, one probe.

Everything here comes from the ``CellPlan``; the component only maps it onto
``pulumi_cloudflare`` and ``pulumi_command`` resources. Commands run from the project
root with the project's virtualenv (``.venv``, as Pulumi.yaml declares), so the
command strings are the same on every machine and never cause a spurious replace.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from typing import TypedDict

import pulumi
import pulumi_cloudflare as cloudflare
from pulumi_command import local

from colocate.cell import cloudflare_limits, rollout
from colocate.cell.plan import POD_URLS_FROM_OUTPUT, Binding, CellPlan, binding_key, pod_urls_text, token_fingerprint
from colocate.errors import ConfigError

from .errors import ProgramError
from .hop import HopCredentials
from .stackconfig import migrations_args

PYTHON = ".venv/bin/python"
# A pod is two commands: `rent` (adopt or place it, then exit: its id is in the stack's state
# before anything waits on it) and `wait` (until it serves). pulumi-command kills a cancelled
# create with SIGKILL, so only what a command printed before the wait is ever recorded.
POD_RENT = f"{PYTHON} scripts/pod.py rent --spec -"
POD_WAIT = f"{PYTHON} scripts/pod.py wait --spec -"
# After every change of the pods, delete the stack's pods that no declared pod holds (a rent
# killed mid-request whose spec has since changed, so no later rent adopts it by name); at
# `pulumi destroy`, every pod of the stack's scope (its delete keeps none): also one from a rent
# killed before it printed its pod's id, which no other resource holds.
POD_SWEEP = f"{PYTHON} scripts/pod.py sweep --stack {{stack}} --scope {{scope}} --destroy"
# The delete reads the pod id from PULUMI_COMMAND_STDOUT (the create's JSON). pulumi-command
# runs it with the environment saved at create; --stack lets it use the stack's current
# provider key first (a rotated key: docs/pods.md, "Rotating a provider key").
POD_DELETE = f"{PYTHON} scripts/pod.py delete --stack {{stack}}"
# Placement goes through the script settings API, not WorkersScript(placement=...): the
# wrapped Terraform provider treats placement.region/host/hostname as read-only
# (terraform-provider-cloudflare #6785, #6936). See scripts/placement.py.
PLACEMENT_APPLY = f"{PYTHON} scripts/placement.py apply"
MODULE_CONTENT_TYPE = "application/javascript+module"


class CellArgs(TypedDict):
    """Inputs of a Cell."""

    plan: CellPlan
    """The cell plan; nothing else decides what is declared."""
    secrets: Mapping[str, pulumi.Input[str]]
    """Secret values by settings key (podToken, readToken, adminToken, exchangeToken, fallbackUrl, ...)."""
    pod_environment: Mapping[str, pulumi.Input[str]]
    """Extra environment for scripts/pod.py: the provider's API key (RUNPOD_API_KEY, VASTAI_API_KEY)."""
    cloudflare_token: pulumi.Input[str]
    """The Cloudflare API token (secret), for scripts/placement.py."""


def _binding_args(script: str, binding: Binding, secrets: Mapping[str, pulumi.Input[str]],
                  pod_urls: pulumi.Output[list], certificate_id: pulumi.Output[str] | None):
    if binding.type == "durable_object_namespace":
        return cloudflare.WorkersScriptBindingArgs(name=binding.name, type=binding.type, class_name=binding.class_name)
    if binding.type == "mtls_certificate":  # the Worker's client certificate for the pod hop (POD_TLS)
        return cloudflare.WorkersScriptBindingArgs(name=binding.name, type=binding.type, certificate_id=certificate_id)

    def within_limits(value: str) -> str:
        # Known only now (a secret, the pods' URLs): the plan checked the rest.
        try:
            cloudflare_limits.check_binding_value(script, binding.name, value, binding_key(binding))
        except ConfigError as err:
            raise ProgramError(str(err)) from None
        return value

    if binding.type == "secret_text":
        text = pulumi.Output.from_input(secrets[binding.secret]).apply(within_limits)
        return cloudflare.WorkersScriptBindingArgs(name=binding.name, type=binding.type, text=text)
    text = pod_urls.apply(lambda urls: within_limits(pod_urls_text(urls))) \
        if binding.from_output == POD_URLS_FROM_OUTPUT else binding.text
    return cloudflare.WorkersScriptBindingArgs(name=binding.name, type=binding.type, text=text)


def by_name(bindings):
    """Bindings in name order, the order Cloudflare's API returns them in: the provider keeps
    the declared order in state, and a declaration in the API's order cannot be matched by
    position to the wrong binding (terraform-provider-cloudflare #7350, #7370)."""
    return sorted(bindings, key=lambda b: b.name)


UPLOAD_DIGEST_PREFIX = b"colocate upload digest v1\0"


def upload_digest(worker, bindings_text: str, secret_values: list[str]) -> str:
    """A digest of what the script's upload carries but its plan does not show: the modules,
    the bindings, their secret values (only digested, never declared) and the migrations."""
    h = hashlib.sha256(UPLOAD_DIGEST_PREFIX)
    for part in (worker.content_hash(), worker.compatibility_date, bindings_text,
                 json.dumps(worker.migrations, sort_keys=True), *secret_values):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _named(name: str, index: int, before_pods: str) -> tuple[str, list]:
    """Pod i's resource name, with an alias for pod 0 to the single-pod name it had
    before the kit ran several pods (so existing stacks keep their pod, not replace it)."""
    return f"{name}-{before_pods}-{index}", [pulumi.Alias(name=f"{name}-{before_pods}")] if index == 0 else []


def module_files(modules, main_module: str) -> dict:
    """The upload's other modules (all but the main one), as WorkersScript ``files``."""
    return {
        m.name: cloudflare.WorkersScriptFilesArgs(
            content_type=MODULE_CONTENT_TYPE,
            content_base64=base64.b64encode(m.content().encode()).decode(),
        )
        for m in modules
        if m.name != main_module
    }


def public_route(name: str, account_id: str, script_name: str, hostname: str | None, zone_id: str | None,
                 opts: pulumi.ResourceOptions):
    """The Worker's public address: a custom domain on the zone, else its workers.dev subdomain."""
    if hostname:
        return cloudflare.WorkersCustomDomain(f"{name}-domain", account_id=account_id, hostname=hostname,
                                              service=script_name, zone_id=zone_id, opts=opts)
    return cloudflare.WorkersScriptSubdomain(f"{name}-workers-dev", account_id=account_id, script_name=script_name,
                                             enabled=True, previews_enabled=False, opts=opts)


class Cell(pulumi.ComponentResource):
    """A colocate cell: Worker placement, the active state generation and the GPU pod move as one."""

    worker_url: pulumi.Output[str]
    pod: pulumi.Output[dict]  # pod 0's create output
    pods: pulumi.Output[list]  # every pod's create output, index order
    probe_result: pulumi.Output[dict]

    def __init__(self, name: str, args: CellArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("colocate:index:Cell", name, None, opts)
        plan, secrets = args["plan"], args["secrets"]
        account_id = plan.worker.account_id

        # The pods, two Commands each (rent, then wait: POD_RENT), index in name and triggers:
        # changing pod.count adds or removes only the pods concerned. A change of what identifies
        # them (triggers) replaces them as colocate.cell.rollout says (the sandbox's apply does the
        # same): create-before-delete, every pod at once (each waits only for itself), and the
        # engine deletes the replaced pods at the end of the update, after the Worker points at
        # the new ones (docs/pods.md: what it costs).
        # Any other input change re-runs the rent (no `update`), which adopts the live pod of
        # the same name. A pod reads its token once, at start, so a rotated colocate:podToken
        # must rename and replace it: the token's fingerprint joins the identity. Only that
        # digest is declared, unsecret, so the spec and triggers stay readable in diffs.
        self.pod_commands: list[local.Command] = []  # the rents: each holds its pod's delete
        self.pod_waits: list[local.Command] = []
        self.pod_dns: list[cloudflare.DnsRecord] = []
        pod_infos = []
        worker_urls = []
        fingerprint = pulumi.Output.unsecret(pulumi.Output.from_input(secrets["podToken"]).apply(token_fingerprint))
        # The hop's certificates (infra/hop.py) when it is mutual TLS: each pod gets its own, by
        # environment; its fingerprint joins the pod's identity (a re-issued one replaces the pod).
        self.hop = HopCredentials(name, plan, self, args["cloudflare_token"]) if plan.mtls else None
        for pod in plan.pods:
            hop_env: dict[str, pulumi.Output[str]] = {}
            declared = fingerprint.apply(pod.with_token_fingerprint)
            if self.hop is not None:
                hop_env, cert_fp = self.hop.pod(pod)
                declared = pulumi.Output.all(declared, cert_fp).apply(lambda a: a[0].with_tls_fingerprint(a[1]))
            cmd_name, aliases = _named(name, pod.index, "pod")
            after = [j for j in (rollout.created_after(pod.index),) if j is not None]
            environment = {"POD_TOKEN": secrets["podToken"], **args["pod_environment"], **hop_env}
            replace_opts = dict(parent=self, delete_before_replace=not rollout.CREATE_BEFORE_DELETE)
            if pod.endpoint is not None and pod.endpoint.ip:  # the team's box by its address: named on the zone
                self.pod_dns.append(self._endpoint_record(name, plan, pod))
            command = local.Command(
                cmd_name,
                create=POD_RENT,
                # An existing endpoint is the team's: no delete, so `pulumi destroy` and a replacement
                # leave it running (its rent records it, its wait checks it: colocate/pods/existing.py).
                delete=None if pod.endpoint is not None else POD_DELETE.format(stack=plan.stack),
                stdin=declared.apply(lambda p: json.dumps(p.spec(), sort_keys=True)),
                environment=environment,
                triggers=declared.apply(lambda p: p.triggers()),
                dir=".",
                opts=pulumi.ResourceOptions(**replace_opts, aliases=aliases,
                                            depends_on=[self.pod_waits[j] for j in after]),
            )
            self.pod_commands.append(command)
            # No delete: the rent's deletes the pod. A new rent (a new pod) replaces the wait too.
            waited = local.Command(
                f"{cmd_name}-ready",
                create=POD_WAIT,
                stdin=pulumi.Output.all(declared, command.stdout).apply(
                    lambda a: json.dumps({**a[0].spec(), "rented": json.loads(a[1])}, sort_keys=True)),
                environment=environment,
                triggers=[command.stdout],
                dir=".",
                opts=pulumi.ResourceOptions(**replace_opts, depends_on=[command]),
            )
            self.pod_waits.append(waited)
            info = waited.stdout.apply(json.loads)
            pod_infos.append(info)
            # How the Worker reaches the pod (plan: pod.path). zone-dns: a DNS-only record on
            # the pod's own port (not proxied: a proxied record would be anycast);
            # provider-proxy and local-hostname need no resource.
            if pod.pod_hostname and pod.endpoint is None:
                dns_name, dns_aliases = _named(name, pod.index, "pod-dns")
                self.pod_dns.append(cloudflare.DnsRecord(
                    dns_name,
                    zone_id=plan.worker.zone_id,
                    name=info.apply(pod.host),  # the instance's own name: a replacement never reuses it
                    type="A",
                    content=info.apply(lambda p: p["ip"]),
                    proxied=False,
                    ttl=60,
                    comment=f"colocate {plan.stack}: pod {pod.index} of generation {pod.generation}",
                    # A new instance has a new name: the record is replaced, not renamed in place (only
                    # zone_id forces that in the provider's schema), new before old, and the old one is
                    # deleted at the end of the update, after the Worker names the new one: the old pod
                    # stays reachable until nothing sends to it (colocate.cell.rollout).
                    opts=pulumi.ResourceOptions(parent=self, aliases=dns_aliases, replace_on_changes=["name"],
                                                delete_before_replace=not rollout.CREATE_BEFORE_DELETE),
                ))
            if pod.in_rotation:  # a draining pod stays declared, out of POD_URLS (colocate:scale)
                worker_urls.append(info.apply(pod.worker_url))
        # pod 0, for callers that knew one pod (none in a cell scaled to zero)
        self.pod_command = self.pod_commands[0] if self.pod_commands else None
        pod_urls = pulumi.Output.all(*worker_urls)

        w = plan.worker
        main = next(m for m in w.modules if m.name == w.main_module)
        # Pod mode: placement.host is pod 0's DNS-only hostname and its public port, known
        # once pod 0 exists (the plan's PlacementHost); otherwise the plan's block as it is.
        self.placement_host: pulumi.Output[str] | None = None
        placement: pulumi.Output[dict] = pulumi.Output.from_input(dict(w.placement))
        if w.placement_host is not None:
            self.placement_host = pod_infos[w.placement_host.pod_index].apply(w.placement_host.value)
            placement = self.placement_host.apply(lambda host: {"host": host})
        self.worker = cloudflare.WorkersScript(
            f"{name}-worker",
            account_id=account_id,
            script_name=w.script_name,
            main_module=w.main_module,
            content=main.content(),
            files=module_files(w.modules, w.main_module),
            compatibility_date=w.compatibility_date,
            compatibility_flags=list(w.compatibility_flags) or None,
            bindings=[_binding_args(w.script_name, b, secrets, pod_urls,
                                    self.hop.mtls_certificate.id if self.hop is not None else None) for b in by_name(w.bindings)],
            migrations=migrations_args(w.migrations),
            observability=cloudflare.WorkersScriptObservabilityArgs(enabled=True),
            # Cloudflare refuses to delete a script that implements a Durable Object class
            # (Breaker) or that another Worker binds (a fleet's front door) unless forced;
            # destroy deletes the class's objects with it (docs/worker.md, "Destroy").
            force=True,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[*self.pod_waits, *self.pod_dns]),
        )

        # The placement block, applied after every upload of the script: the upload itself
        # carries none (see PLACEMENT_APPLY), and whether an upload keeps the block it last
        # had is not documented, so whatever makes the script upload again (its modules,
        # bindings and their secret values, migrations, the pods' URLs) re-applies it.
        bindings_text = json.dumps([b.__dict__ for b in w.bindings], default=str, sort_keys=True)
        secret_values = [secrets[b.secret] for b in w.bindings if b.secret]
        upload = pulumi.Output.unsecret(pulumi.Output.all(*secret_values).apply(
            lambda values: upload_digest(w, bindings_text, values)))
        self.placement = local.Command(
            f"{name}-placement",
            create=f"{PLACEMENT_APPLY} --account {account_id} --script {w.script_name}",
            stdin=placement.apply(lambda block: json.dumps(block, sort_keys=True)),
            environment={"CLOUDFLARE_API_TOKEN": args["cloudflare_token"]},
            triggers=[placement.apply(lambda block: json.dumps(block, sort_keys=True)), upload,
                      *[c.stdout for c in self.pod_waits],
                      *([self.hop.mtls_certificate.id] if self.hop is not None else [])],  # a new one re-uploads
            dir=".",
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.worker]),
        )

        self.route = public_route(name, account_id, w.script_name, w.hostname, w.zone_id,
                                  pulumi.ResourceOptions(parent=self, depends_on=[self.worker]))

        after_worker = pulumi.ResourceOptions(parent=self, depends_on=[self.worker, self.route])
        # Each command holds only the credentials it needs: purging administers; the probe reads,
        # and mints (then revokes) the short-lived client key of its routed samples.
        secret_of = {b.name: b.secret for b in w.bindings}
        admin_env = {"COLOCATE_ADMIN_TOKEN": secrets[secret_of["ADMIN_TOKEN"]]}
        probe_env = {"COLOCATE_READ_TOKEN": secrets[secret_of["READ_TOKEN"]], **admin_env}
        # Retired generations: purge their storage once (their binding is already gone).
        self.purges = [
            local.Command(
                f"{name}-purge-{gen}",
                create=f"{PYTHON} scripts/migrate.py purge --url {w.url} --generation {gen}",
                environment=admin_env,
                dir=".",
                opts=after_worker,
            )
            for gen in plan.state.purge
        ]

        # The post-deploy probe: first touch of a new generation (with its hint), then the
        # measured truth. Re-runs whenever the Worker or any pod changes.
        self.probe = local.Command(
            f"{name}-probe",
            create=pulumi.Output.all(pulumi.Output.from_input(self.placement_host),
                                     self.hop.not_after() if self.hop is not None else None, *pod_infos).apply(
                lambda args: " ".join([PYTHON, *plan.probe.argv(w.url, [p["location"] for p in args[2:]], args[0],
                                                                 hop_not_after=args[1] or None)])),
            environment=probe_env,
            triggers=[w.content_hash(), bindings_text, json.dumps(w.placement, sort_keys=True),
                      *[c.stdout for c in self.pod_waits]],
            dir=".",
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.worker, self.placement, self.route,
                                                                 *self.pod_waits]),
        )
        # The stack's pods that no declared pod holds are deleted once the Worker no longer names
        # them (plan.sweep_provider): re-run whenever a pod changes (its ids are in the command).
        self.sweep = None
        if plan.sweep_provider is not None:
            provider = plan.sweep_provider
            keep = pulumi.Output.all(*[c.stdout for c in self.pod_commands], *[c.stdout for c in self.pod_waits]).apply(
                lambda outs: sorted({json.loads(o)["id"] for o in outs}))
            sweep = POD_SWEEP.format(stack=plan.stack, scope=plan.scope or "''")
            self.sweep = local.Command(
                f"{name}-pod-sweep",
                create=keep.apply(lambda ids: " ".join([sweep, "--provider", provider, *[f"--keep {i}" for i in ids]])),
                delete=f"{sweep} --provider {provider}",
                environment=dict(args["pod_environment"]),
                dir=".",
                opts=pulumi.ResourceOptions(parent=self, depends_on=[self.worker, *self.pod_waits]),
            )
        self.worker_url = pulumi.Output.from_input(w.url)
        self.pod = pod_infos[0] if pod_infos else pulumi.Output.from_input({})
        self.pods = pulumi.Output.all(*pod_infos)
        self.probe_result = self.probe.stdout.apply(lambda out: json.loads(out) if out else {})
        self.register_outputs({"workerUrl": self.worker_url, "pod": self.pod, "pods": self.pods,
                               "probe": self.probe_result, "placementHost": self.placement_host})

    def _endpoint_record(self, name: str, plan: CellPlan, pod) -> cloudflare.DnsRecord:
        """The DNS-only record that names an existing endpoint's ip on the zone (the Worker cannot fetch an IP
        literal): known from the plan, so it exists before the box is checked; the box's, not the kit's, to
        move (a changed ip updates it in place)."""
        assert pod.endpoint is not None
        return cloudflare.DnsRecord(
            f"{name}-endpoint-dns-{pod.index}",
            zone_id=plan.worker.zone_id,
            name=pod.endpoint.host,
            type="AAAA" if ":" in pod.endpoint.ip else "A",
            content=pod.endpoint.ip,
            proxied=False,  # a proxied record would be anycast: placement could not find the box
            ttl=60,
            comment=f"colocate {plan.stack}: endpoint {pod.index} (the team's own box)",
            opts=pulumi.ResourceOptions(parent=self),
        )
