"""create / delete / status / sweep: the provider-neutral steps behind ``scripts/pod.py``.

create: adopt a live pod that already carries the spec's name, otherwise walk the region's
candidates (RunPod data centres in catalogue order, Vast.ai offers cheapest first) until
one accepts; then wait for readiness. Anything created by this call is destroyed again if
any later step fails (or the process is interrupted): pulumi-command keeps the output of a
create only when it exits 0, so a pod left behind here would bill with no record.

Adopting is sound because the name carries a digest of everything that fixes what a pod is
(``colocate.cell.plan.PodPlan.identity``: image, GPU, port, disk, path, token, ...): a live pod of
that name is this spec's pod, and only the placement criteria (price cap, reliability) may
differ, which apply to the next placement only. One case it cannot tell apart, as the spec
is identical too: `pulumi up --replace` of a pod keeps its name, so its create adopts the
pod that the old resource's delete then destroys (docs/pods.md, "What replaces a pod").

The same name makes "one spec, one GPU" checkable: a create whose reply was lost (5xx, read
timeout) may land after we looked for it and posted again, or moved on to the next location.
So a successful create lists the pods once more, after readiness (which gives a late pod the
most time to show up), and destroys every other live pod of the name; a failed one destroys
every pod of the name whenever a create went unanswered.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from ..cell.catalogue import EXISTING
from ..cell.plan import instance_host
from . import existing, podtls, stop
from .base import DEAD, RUNNING, PodInfo, Provider, belongs_to_stack, scope_of
from .errors import CapacityError, NotFoundError, PodConfigError, ProviderError, RetryableError, format_attempts
from .guard.colocate_pod_guard import readiness_token
from .readiness import wait_ready
from .spec import PodSpec

CREATE_ROUNDS = 3  # a create answered by 5xx/timeout is looked up by name, then posted again at most this often
# Why a pod of the spec's name that create did not return is destroyed (stderr).
LATE = "a create whose reply was lost landed late"
EARLIER = "another pod of this name, left by an earlier create"


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def provider_for(name: str, token: str = "") -> Provider:
    # Each provider's module is imported only when it is used: pod.py for a local pod never
    # loads the cloud providers' HTTP client (requests).
    if name == "runpod":
        from .runpod import RunPod

        return RunPod(token)
    if name == "vastai":
        from .vastai import VastAI

        return VastAI(token)
    if name == "local":
        from .local import Local

        return Local(token)
    if name == EXISTING:
        from .existing import Existing

        return Existing(token)
    raise PodConfigError(f"provider {name!r} is not one of runpod, vastai, local, {EXISTING}")


def pod_token(provider: str) -> str:
    token = os.environ.get("POD_TOKEN", "")
    if not token and provider != "local":
        raise PodConfigError("POD_TOKEN is not set: a cloud pod without it would serve anyone. "
                             "Fix: export POD_TOKEN (pulumi config colocate:podToken --secret)")
    return token


def result(spec: PodSpec, provider: str, info: PodInfo, adopted: bool) -> dict:
    out = {"id": info.id, "provider": provider, "location": info.location, "url": info.url,
           "cost_per_hr": info.cost_per_hr, "gpu": info.gpu or spec.gpu, "name": spec.name,
           "ip": info.ip, "port": info.port, "market": info.market or spec.market}
    if adopted:
        out["adopted"] = True
    return out


def _provider(spec: PodSpec) -> tuple[Provider, str]:
    """The spec's provider, set up for its hop: (provider, pod token). Everything a create
    needs is checked here, before anything is rented."""
    token = pod_token(spec.provider)
    if spec.mtls:
        try:
            provider_tls, checker = podtls.bundle_from_env(), podtls.checker_from_env()
        except podtls.PodTlsError as exc:
            raise PodConfigError(str(exc)) from None
    provider = provider_for(spec.provider, token)
    if hasattr(provider, "serve_port"):
        provider.serve_port = spec.port
    if spec.mtls:
        provider.pod_tls = provider_tls
        provider.checker = (checker, spec.tls_name)
    return provider, token


def create(spec: PodSpec) -> dict:
    """Rent (or adopt) and wait, in one process: ``rent`` then ``wait`` without a record between them."""
    if spec.provider == EXISTING:  # checked, never rented nor destroyed
        return existing.create(spec)
    provider, token = _provider(spec)
    try:
        pod_id, adopted, unknown = _acquire(spec, provider, token)
        return _ready_or_destroy(spec, provider, pod_id, adopted=adopted, unknown=unknown)
    finally:
        provider.close()


def rent(spec: PodSpec) -> dict:
    """Adopt the live pod of the spec's name, or place one; never wait for it. Its output (the
    pod's id and name) is what the stack records before the long readiness wait: a `pulumi up`
    cancelled during that wait (pulumi-command kills the command with SIGKILL, so no handler runs)
    leaves a pod the stack's state holds, and `pulumi destroy` deletes it."""
    if spec.provider == EXISTING:
        return existing.rent(spec)
    provider, token = _provider(spec)
    try:
        pod_id, adopted, unknown = _acquire(spec, provider, token)
    finally:
        provider.close()
    out: dict[str, str | bool] = {"id": pod_id, "provider": spec.provider, "name": spec.name}
    if adopted:
        out["adopted"] = True
    if unknown:
        out["unknown"] = True  # other pods of the name may exist: wait destroys them
    return out


def wait(spec: PodSpec, rented: object) -> dict:
    """Wait for the pod ``rent`` recorded (``rented``: its output) to serve; the output is ``create``'s.
    A recorded pod that is gone or dead (deleted by hand, reclaimed, or destroyed by a failed wait)
    is replaced under the same name: adopt one of the name, else place one (``pod.py delete`` of the
    rent deletes every live pod of the recorded name). A pod that never serves is destroyed, as
    ``create`` does: the next ``pulumi up`` places a new one here."""
    if spec.provider == EXISTING:
        return existing.wait(spec, rented)
    if not isinstance(rented, dict) or rented.get("name") != spec.name or rented.get("provider") != spec.provider:
        raise PodConfigError(f"wait: the rented pod {rented!r} is not this spec's ({spec.provider} {spec.name}). "
                             "Fix: pass the spec with `rented` set to the JSON `pod.py rent` printed for it")
    provider, token = _provider(spec)
    try:
        pod_id, adopted, unknown = str(rented.get("id") or ""), bool(rented.get("adopted")), bool(rented.get("unknown"))
        try:
            gone = provider.describe(pod_id).state == DEAD if pod_id else True
            if gone and pod_id:  # it will never serve, and a stopped pod can still bill its disk
                log(f"destroying {pod_id}: it will never serve" if provider.destroy(pod_id) else f"{pod_id}: already gone")
        except NotFoundError:
            gone = True
        if gone:
            log(f"{provider.name} pod {pod_id or '?'} ({spec.name}) is gone or will never serve; placing its replacement")
            pod_id, adopted, more = _acquire(spec, provider, token)
            unknown = unknown or more
        return _ready_or_destroy(spec, provider, pod_id, adopted=adopted, unknown=unknown)
    finally:
        provider.close()


def _acquire(spec: PodSpec, provider: Provider, token: str) -> tuple[str, bool, bool]:
    """(pod id, adopted, other pods of the name may exist): adopt the live pod of the spec's name, else place one."""
    live = _named(spec, provider)
    if live:
        # Several (left by an earlier create): keep one that already runs, destroy the rest once it is ready.
        pod = next((p for p in live if p.state == RUNNING), live[0])
        log(f"adopting {spec.name}: {provider.name} pod {pod.id} already exists ({pod.raw_state}); not creating another "
            "(maxPricePerHr, minReliability and minCudaVersion apply to the next placement only)")
        if len(live) > 1:
            log(f"warning: {len(live) - 1} more live pod(s) carry the name {spec.name}; destroying them once {pod.id} is ready")
        return pod.id, True, len(live) > 1
    lost: list[str] = []  # creates that went unanswered: each may have landed, now or later, under spec.name
    try:
        pod_id, attempts = _place(spec, provider, token, lost)
        if pod_id is None and spec.interruptible and spec.on_demand_fallback:
            # colocate:pod.market mix: no interruptible capacity left in the region, so on demand (colocate/cell/market.py)
            log(f"no interruptible capacity for {spec.gpu} in {spec.region}: renting {spec.name} on demand "
                f"(colocate:pod.market mix), at most ${spec.max_price_per_hr}/h")
            pod_id, more = _place(dataclasses.replace(spec, market="ondemand"), provider, token, lost)
            attempts += more
        stop.check()  # a SIGTERM during the create: it landed, and is destroyed by its name below
    except BaseException as exc:  # includes KeyboardInterrupt / SystemExit from SIGTERM
        # Interrupted while a create was in flight, or a create went unanswered: it may have
        # landed without us learning its id. Find it by its name and destroy it.
        if lost or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            why = "created as the interrupt arrived" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else LATE
            _destroy_named(spec, provider, why)
        raise
    if pod_id is None:
        # Nothing placed anywhere, but an unanswered create may have landed since it was last looked for.
        left = "nothing was left running"
        if lost and not _destroy_named(spec, provider, LATE):
            left = (f"a pod named {spec.name} may be left running (see the ERROR above); "
                    f"run `.venv/bin/python scripts/pod.py sweep --stack {spec.stack} --destroy`")
        table = format_attempts(attempts)
        log(f"no capacity for {spec.gpu} in {spec.region} (never another region):\n{table}")
        raise CapacityError(f"no capacity for {spec.gpu} x{spec.gpu_count} with {spec.provider} in region "
                            f"{spec.region} (locations {', '.join(spec.locations)}); {left}", attempts)
    return pod_id, False, bool(lost)


def _scheme(spec: PodSpec, info: PodInfo) -> PodInfo:
    if spec.mtls:
        info.scheme = "https"
    return info


def _named(spec: PodSpec, provider: Provider) -> list[PodInfo]:
    return [p for p in provider.list_pods() if p.name == spec.name and p.state != DEAD]


def _destroy_named(spec: PodSpec, provider: Provider, why: str, keep: str | None = None) -> bool:
    """Destroy every live pod named ``spec.name`` but ``keep``; False (and an ERROR with the fix) if it could not look."""
    try:
        for pod in _named(spec, provider):
            if pod.id != keep:
                log(f"destroying {'duplicate ' if keep else ''}{pod.id} ({why})")
                log(f"destroyed {pod.id}" if provider.destroy(pod.id) else f"{pod.id}: already gone")
    except Exception as cleanup:  # noqa: BLE001 - report; the failure that brought us here is what matters
        kept = f" --keep {keep}" if keep else ""
        log(f"ERROR: could not look for (or destroy) other {provider.name} pods named {spec.name} ({cleanup}); "
            f"one may be billing with no record. Fix: run `.venv/bin/python scripts/pod.py sweep --stack {spec.stack}"
            f"{kept} --destroy` once {provider.name} answers")
        return False
    return True


def _place(spec: PodSpec, provider: Provider, token: str, lost: list[str]) -> tuple[str | None, list]:
    """(the id of the pod placed, or None when no location took it; the attempt table). Appends to
    ``lost`` each create that went unanswered, so the caller can find it by name if it lands late."""
    candidates, attempts = provider.candidates(spec)
    for cand in candidates:
        for _ in range(CREATE_ROUNDS):
            try:
                pod_id = provider.create(spec, cand, token)
                log(f"created {provider.name} pod {pod_id} ({spec.name})")
                return pod_id, attempts
            except CapacityError as exc:
                attempts += exc.attempts
                log(f"not placed: {exc.attempts[-1][0]} {exc.attempts[-1][2]}; trying the next location of {spec.region}")
                break
            except RetryableError as exc:
                lost.append(str(exc))
                # The create may have landed: look before posting again (never two GPUs).
                log(f"create unanswered ({exc}); looking for {spec.name} before retrying")
                try:
                    found = _named(spec, provider)
                except ProviderError as listing:
                    # Posting again without knowing could rent a second GPU: stop here. The caller
                    # looks once more by name and destroys what it finds.
                    raise RetryableError(
                        f"{provider.name}: a create of {spec.name} went unanswered ({exc}) and listing pods to look for it "
                        f"failed too ({listing}); not posting again. Fix: retry once {provider.name} answers") from None
                if found:
                    return found[0].id, attempts
        else:
            attempts.append((provider.location_of(cand), spec.gpu, f"create unanswered {CREATE_ROUNDS} times"))
    return None, attempts


def _ready_or_destroy(spec: PodSpec, provider: Provider, pod_id: str, adopted: bool, unknown: bool) -> dict:
    """Wait for ``pod_id`` to serve, then make it the only live pod of the name. ``unknown``: other
    pods of the name may exist (unanswered creates, or several found at adoption)."""
    tls = getattr(provider, "checker", None)
    if tls is not None and tls[1].startswith("*."):  # zone-dns: the instance's own name under the slot's
        tls = (tls[0], instance_host(tls[1][2:], provider.name, pod_id))
    try:
        pod_token = os.environ.get("POD_TOKEN", "")  # only its one-way derivative goes to readiness
        info = wait_ready(lambda: _scheme(spec, provider.describe(pod_id)), spec.ready_timeout_s, log=log,
                          no_address_fix=provider.no_address_fix(spec), tls=tls,
                          token=readiness_token(pod_token) if pod_token else None)
        log(f"ready: {info.id} at {info.url} ({info.location}, ${info.cost_per_hr}/h)")
        # One list per create, even without a lost reply: a pod of this name that is not the one
        # returned is on no record and would bill. If the list fails, the ready pod is still
        # returned (failing would leave a possible duplicate and lose the recorded pod too).
        _destroy_named(spec, provider, EARLIER if adopted else LATE, keep=pod_id)
        return result(spec, provider.name, info, adopted)
    except BaseException as exc:  # includes KeyboardInterrupt / SystemExit from SIGTERM
        log(f"{type(exc).__name__}: destroying {pod_id} so nothing is left billing")
        try:
            provider.destroy(pod_id)
            log(f"destroyed {pod_id}")
        except Exception as cleanup:  # report both; the original failure is the one that matters
            log(
                f"ERROR: could not destroy {pod_id} ({cleanup}); "
                f"run `.venv/bin/python scripts/pod.py sweep --stack {spec.stack} --destroy`"
            )
        if unknown:
            _destroy_named(spec, provider, EARLIER if adopted else LATE)
        raise


def delete(provider_name: str, pod_id: str, name: str | None = None) -> dict:
    """Delete ``pod_id``; with ``name`` (a rent's record), every other live pod of that name too: the
    name is the pod's identity, and a wait may have replaced a gone pod under it."""
    provider = provider_for(provider_name)
    also = []
    try:
        gone_before = not provider.destroy(pod_id)
        if name:
            for pod in provider.list_pods():
                if pod.name == name and pod.id != pod_id:
                    log(f"destroying {pod.id}: it carries the recorded name {name}")
                    provider.destroy(pod.id)
                    also.append(pod.id)
    finally:
        provider.close()
    log(f"{pod_id}: {'already gone' if gone_before else 'deleted'}")
    out = {"id": pod_id, "provider": provider_name, "deleted": True, "already_gone": gone_before}
    if also:
        out["also_deleted"] = also
    return out


def status(provider_name: str, pod_id: str) -> dict:
    provider = provider_for(provider_name)
    try:
        info = provider.describe(pod_id)
    finally:
        provider.close()
    return {"provider": provider_name, **info.as_dict()}


def sweep(stack: str, providers: list[str], keep: list[str], destroy: bool, scope: str | None = None) -> dict:
    """The stack's pods but ``keep``. With ``scope`` (the stack's ``podScope``), only pods of that scope or
    of none; without, every scope is listed but only unscoped names are destroyed: a pod of another
    scope may be another project's stack of the same name."""
    found, destroyed, held = [], [], []
    for name in providers:
        provider = provider_for(name)
        try:
            for pod in provider.list_pods():
                if not belongs_to_stack(pod.name, stack, scope) or pod.id in keep:
                    continue
                found.append({"provider": name, **pod.as_dict()})
                if destroy and (scope is not None or scope_of(pod.name, stack) == ""):
                    provider.destroy(pod.id)
                    destroyed.append(pod.id)
                    log(f"destroyed stray {name} pod {pod.id} ({pod.name})")
                elif destroy:
                    held.append(pod.id)
                    log(f"not destroying {name} pod {pod.id} ({pod.name}): its scope may be another project's; "
                        f"pass --scope $(pulumi stack output podScope --stack {stack}) to delete this stack's")
                else:
                    log(f"stray {name} pod {pod.id} ({pod.name}, {pod.raw_state}); --destroy removes it")
        finally:
            provider.close()
    out = {"stack": stack, "strays": found, "destroyed": destroyed, "kept": keep}
    if held:
        out["held"] = held
    return out
