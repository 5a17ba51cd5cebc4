"""The ``Cell`` component: one Worker, one state generation, one GPU pod, one probe.

Everything here comes from the ``CellPlan``; the component only maps it onto
``pulumi_cloudflare`` and ``pulumi_command`` resources. Commands run from the project
root with the project's virtualenv (``.venv``, as Pulumi.yaml declares), so the
command strings are the same on every machine and never cause a spurious replace.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import TypedDict

import pulumi
import pulumi_cloudflare as cloudflare
from pulumi_command import local

from colocate.plan import POD_URLS_FROM_OUTPUT, Binding, CellPlan, pod_urls_text

PYTHON = ".venv/bin/python"
POD_CREATE = f"{PYTHON} scripts/pod.py create --spec -"
# The delete reads the pod id from PULUMI_COMMAND_STDOUT (the create's JSON).
POD_DELETE = f"{PYTHON} scripts/pod.py delete"
MODULE_CONTENT_TYPE = "application/javascript+module"


class CellArgs(TypedDict):
    """Inputs of a Cell."""

    plan: CellPlan
    """The cell plan; nothing else decides what is declared."""
    secrets: Mapping[str, pulumi.Input[str]]
    """Secret values by settings key (podToken, probeToken, fallbackUrl, fallbackApiKey, ...)."""
    pod_environment: Mapping[str, pulumi.Input[str]]
    """Extra environment for scripts/pod.py: the provider's API key (RUNPOD_API_KEY, VASTAI_API_KEY)."""


def _binding_args(binding: Binding, secrets: Mapping[str, pulumi.Input[str]], pod_url: pulumi.Input[str]):
    if binding.type == "durable_object_namespace":
        return cloudflare.WorkersScriptBindingArgs(name=binding.name, type=binding.type, class_name=binding.class_name)
    if binding.type == "secret_text":
        return cloudflare.WorkersScriptBindingArgs(name=binding.name, type=binding.type, text=secrets[binding.secret])
    text = pod_url.apply(lambda u: pod_urls_text([u])) if binding.from_output == POD_URLS_FROM_OUTPUT else binding.text
    return cloudflare.WorkersScriptBindingArgs(name=binding.name, type=binding.type, text=text)


def _migrations(plan: CellPlan) -> cloudflare.WorkersScriptMigrationsArgs:
    m = plan.worker.migrations
    steps = [cloudflare.WorkersScriptMigrationsStepArgs(**step) for step in m["steps"]]
    return cloudflare.WorkersScriptMigrationsArgs(old_tag=m["old_tag"], new_tag=m["new_tag"], steps=steps)


class Cell(pulumi.ComponentResource):
    """A colocate cell: Worker placement, the active state generation and the GPU pod move as one."""

    worker_url: pulumi.Output[str]
    pod: pulumi.Output[dict]
    probe_result: pulumi.Output[dict]

    def __init__(self, name: str, args: CellArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("colocate:index:Cell", name, None, opts)
        plan, secrets = args["plan"], args["secrets"]
        child = pulumi.ResourceOptions(parent=self)
        account_id = plan.worker.account_id

        # The pod: any change to what identifies it (triggers) replaces it, new before old.
        self.pod_command = local.Command(
            f"{name}-pod",
            create=POD_CREATE,
            delete=POD_DELETE,
            stdin=json.dumps(plan.pod.spec(), sort_keys=True),
            environment={"POD_TOKEN": secrets["podToken"], **args["pod_environment"]},
            triggers=plan.pod.triggers(),
            dir=".",
            opts=pulumi.ResourceOptions(parent=self, delete_before_replace=False),
        )
        pod_info = self.pod_command.stdout.apply(json.loads)

        # How the Worker reaches the pod: a DNS-only hostname on the pod's own port when
        # a zone is configured (not proxied: a proxied record would be anycast), else the
        # address the provider reports.
        self.pod_dns = None
        if plan.pod.pod_hostname:
            self.pod_dns = cloudflare.DnsRecord(
                f"{name}-pod-dns",
                zone_id=plan.worker.zone_id,
                name=plan.pod.pod_hostname,
                type="A",
                content=pod_info.apply(lambda p: p["ip"]),
                proxied=False,
                ttl=60,
                comment=f"colocate {plan.stack}: pod of generation {plan.pod.generation}",
                opts=child,
            )
        pod_url = pod_info.apply(plan.pod.worker_url)

        w = plan.worker
        main = next(m for m in w.modules if m.name == w.main_module)
        self.worker = cloudflare.WorkersScript(
            f"{name}-worker",
            account_id=account_id,
            script_name=w.script_name,
            main_module=w.main_module,
            content=main.content(),
            files={
                m.name: cloudflare.WorkersScriptFilesArgs(
                    content_type=MODULE_CONTENT_TYPE,
                    content_base64=base64.b64encode(m.path.read_bytes()).decode(),
                )
                for m in w.modules
                if m.name != w.main_module
            },
            compatibility_date=w.compatibility_date,
            placement=cloudflare.WorkersScriptPlacementArgs(**w.placement),
            bindings=[_binding_args(b, secrets, pod_url) for b in w.bindings],
            migrations=_migrations(plan),
            observability=cloudflare.WorkersScriptObservabilityArgs(enabled=True),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[r for r in (self.pod_command, self.pod_dns) if r]),
        )

        if w.hostname:
            self.route = cloudflare.WorkersCustomDomain(
                f"{name}-domain",
                account_id=account_id,
                hostname=w.hostname,
                service=w.script_name,
                zone_id=w.zone_id,
                opts=pulumi.ResourceOptions(parent=self, depends_on=[self.worker]),
            )
        else:
            self.route = cloudflare.WorkersScriptSubdomain(
                f"{name}-workers-dev",
                account_id=account_id,
                script_name=w.script_name,
                enabled=True,
                previews_enabled=False,
                opts=pulumi.ResourceOptions(parent=self, depends_on=[self.worker]),
            )

        after_worker = pulumi.ResourceOptions(parent=self, depends_on=[self.worker, self.route])
        probe_env = {"COLOCATE_PROBE_TOKEN": secrets["probeToken"]}
        # The provider keeps no record of applied migration tags: the kit writes the new
        # tag into the stack file once the Worker carrying it is deployed.
        self.migration_record = None
        if w.pending_migrations:
            tag = w.migrations["new_tag"]
            self.migration_record = local.Command(
                f"{name}-migration-tag",
                create=f"{PYTHON} scripts/migrate.py record-tag --stack {plan.stack} --tag {tag}",
                triggers=[tag],
                dir=".",
                opts=after_worker,
            )
        # Retired generations: purge their storage once (their binding is already gone).
        self.purges = [
            local.Command(
                f"{name}-purge-{gen}",
                create=f"{PYTHON} scripts/migrate.py purge --url {w.url} --generation {gen}",
                environment=probe_env,
                dir=".",
                opts=after_worker,
            )
            for gen in plan.state.purge
        ]

        # The post-deploy probe: first touch of a new generation (with its hint), then the
        # measured truth. Re-runs whenever the Worker or the pod changes.
        self.probe = local.Command(
            f"{name}-probe",
            create=pod_info.apply(lambda pod: " ".join([PYTHON, *plan.probe.argv(w.url, pod["location"])])),
            environment=probe_env,
            triggers=[w.content_hash(), json.dumps([b.__dict__ for b in w.bindings], default=str, sort_keys=True),
                      json.dumps(w.placement, sort_keys=True), self.pod_command.stdout],
            dir=".",
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.worker, self.route, self.pod_command]),
        )
        self.worker_url = pulumi.Output.from_input(w.url)
        self.pod = pod_info
        self.probe_result = self.probe.stdout.apply(lambda out: json.loads(out) if out else {})
        self.register_outputs({"workerUrl": self.worker_url, "pod": self.pod, "probe": self.probe_result})
