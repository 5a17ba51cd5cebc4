"""create / delete / status / sweep: the provider-neutral steps behind ``scripts/pod.py``.

create: adopt a live pod that already carries the spec's name, otherwise walk the region's
candidates (RunPod data centres in catalogue order, Vast.ai offers cheapest first) until
one accepts; then wait for readiness. Anything created by this call is destroyed again if
any later step fails (or the process is interrupted): pulumi-command keeps the output of a
create only when it exits 0, so a pod left behind here would bill with no record.

Adopting is sound because the name carries a digest of everything that fixes what a pod is
(``colocate.plan.PodPlan.identity``: image, GPU, port, disk, path, token, ...): a live pod of
that name is this spec's pod, and only the placement criteria (price cap, reliability) may
differ, which apply to the next placement only. One case it cannot tell apart, as the spec
is identical too: `pulumi up --replace` of a pod keeps its name, so its create adopts the
pod that the old resource's delete then destroys (docs/pods.md, "What replaces a pod").
"""

from __future__ import annotations

import os
import sys

from .base import DEAD, PodInfo, Provider, belongs_to_stack
from .errors import CapacityError, PodConfigError, RetryableError, format_attempts
from .readiness import wait_ready
from .spec import PodSpec

CREATE_ROUNDS = 3  # a create answered by 5xx/timeout is looked up by name, then posted again at most this often


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def provider_for(name: str, token: str = "") -> Provider:
    from .local import Local
    from .runpod import RunPod
    from .vastai import VastAI

    classes = {"runpod": RunPod, "vastai": VastAI, "local": Local}
    if name not in classes:
        raise PodConfigError(f"provider {name!r} is not one of {', '.join(classes)}")
    return classes[name](token)


def pod_token(provider: str) -> str:
    token = os.environ.get("POD_TOKEN", "")
    if not token and provider != "local":
        raise PodConfigError("POD_TOKEN is not set: a cloud pod without it would serve anyone. "
                             "Fix: export POD_TOKEN (pulumi config colocate:podToken --secret)")
    return token


def result(spec: PodSpec, provider: str, info: PodInfo, adopted: bool) -> dict:
    out = {"id": info.id, "provider": provider, "location": info.location, "url": info.url,
           "cost_per_hr": info.cost_per_hr, "gpu": info.gpu or spec.gpu, "name": spec.name,
           "ip": info.ip, "port": info.port}
    if adopted:
        out["adopted"] = True
    return out


def create(spec: PodSpec) -> dict:
    token = pod_token(spec.provider)
    provider = provider_for(spec.provider, token)
    if hasattr(provider, "serve_port"):
        provider.serve_port = spec.port
    try:
        return _create(spec, provider, token)
    finally:
        provider.close()


def _create(spec: PodSpec, provider: Provider, token: str) -> dict:
    live = [p for p in provider.list_pods() if p.name == spec.name and p.state != DEAD]
    if live:
        pod = live[0]
        log(f"adopting {spec.name}: {provider.name} pod {pod.id} already exists ({pod.raw_state}); not creating another "
            "(maxPricePerHr and minReliability apply to the next placement only)")
        for extra in live[1:]:
            log(f"warning: {extra.id} also carries the name {spec.name}; `sweep --keep {pod.id} --destroy` removes it")
        return _ready_or_destroy(spec, provider, pod.id, adopted=True)
    try:
        pod_id = _place(spec, provider, token)
    except (KeyboardInterrupt, SystemExit):
        # Interrupted while a create was in flight: it may have landed without us
        # learning its id. Find it by its name and destroy it.
        _destroy_named(spec, provider)
        raise
    return _ready_or_destroy(spec, provider, pod_id, adopted=False)


def _destroy_named(spec: PodSpec, provider: Provider) -> None:
    try:
        for pod in provider.list_pods():
            if pod.name == spec.name and pod.state != DEAD:
                provider.destroy(pod.id)
                log(f"destroyed {pod.id} (created as the interrupt arrived)")
    except Exception as cleanup:  # noqa: BLE001 - report; the interrupt is what matters
        log(f"ERROR: could not look for {spec.name} ({cleanup}); run `.venv/bin/python scripts/pod.py sweep --stack {spec.stack} --destroy`")


def _place(spec: PodSpec, provider: Provider, token: str) -> str:
    candidates, attempts = provider.candidates(spec)
    for cand in candidates:
        for _ in range(CREATE_ROUNDS):
            try:
                pod_id = provider.create(spec, cand, token)
                log(f"created {provider.name} pod {pod_id} ({spec.name})")
                return pod_id
            except CapacityError as exc:
                attempts += exc.attempts
                log(f"not placed: {exc.attempts[-1][0]} {exc.attempts[-1][2]}; trying the next location of {spec.region}")
                break
            except RetryableError as exc:
                # The create may have landed: look before posting again (never two GPUs).
                log(f"create unanswered ({exc}); looking for {spec.name} before retrying")
                found = [p for p in provider.list_pods() if p.name == spec.name and p.state != DEAD]
                if found:
                    return found[0].id
        else:
            attempts.append((provider.location_of(cand), spec.gpu, f"create unanswered {CREATE_ROUNDS} times"))
    table = format_attempts(attempts)
    log(f"no capacity for {spec.gpu} in {spec.region} (never another region):\n{table}")
    raise CapacityError(f"no capacity for {spec.gpu} x{spec.gpu_count} with {spec.provider} in region "
                        f"{spec.region} (locations {', '.join(spec.locations)}); nothing was left running", attempts)


def _ready_or_destroy(spec: PodSpec, provider: Provider, pod_id: str, adopted: bool) -> dict:
    try:
        info = wait_ready(lambda: provider.describe(pod_id), spec.ready_timeout_s, log=log)
        log(f"ready: {info.id} at {info.url} ({info.location}, ${info.cost_per_hr}/h)")
        return result(spec, provider.name, info, adopted)
    except BaseException as exc:  # includes KeyboardInterrupt / SystemExit from SIGTERM
        log(f"{type(exc).__name__}: destroying {pod_id} so nothing is left billing")
        try:
            provider.destroy(pod_id)
            log(f"destroyed {pod_id}")
        except Exception as cleanup:  # report both; the original failure is the one that matters
            log(f"ERROR: could not destroy {pod_id} ({cleanup}); run `.venv/bin/python scripts/pod.py sweep --stack {spec.stack} --destroy`")
        raise


def delete(provider_name: str, pod_id: str) -> dict:
    provider = provider_for(provider_name)
    try:
        gone_before = not provider.destroy(pod_id)
    finally:
        provider.close()
    log(f"{pod_id}: {'already gone' if gone_before else 'deleted'}")
    return {"id": pod_id, "provider": provider_name, "deleted": True, "already_gone": gone_before}


def status(provider_name: str, pod_id: str) -> dict:
    provider = provider_for(provider_name)
    try:
        info = provider.describe(pod_id)
    finally:
        provider.close()
    return {"provider": provider_name, **info.as_dict()}


def sweep(stack: str, providers: list[str], keep: list[str], destroy: bool) -> dict:
    found, destroyed = [], []
    for name in providers:
        provider = provider_for(name)
        try:
            for pod in provider.list_pods():
                if belongs_to_stack(pod.name, stack) and pod.id not in keep:
                    found.append({"provider": name, **pod.as_dict()})
                    if destroy:
                        provider.destroy(pod.id)
                        destroyed.append(pod.id)
                        log(f"destroyed stray {name} pod {pod.id} ({pod.name})")
                    else:
                        log(f"stray {name} pod {pod.id} ({pod.name}, {pod.raw_state}); --destroy removes it")
        finally:
            provider.close()
    return {"stack": stack, "strays": found, "destroyed": destroyed, "kept": keep}
