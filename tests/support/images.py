"""Pod images the tests name. A RunPod pod without colocate:zone is reached through RunPod's proxy,
where only the pod's guard keeps strangers out, so the plan refuses the stock image there
(colocate/cell/plan.py ``check_guard_image``): tests of such cells run the kit's image (pod/Dockerfile)."""

GUARDED_IMAGE = "registry.example.com/colocate-vllm:v0.33.0-cu129"


def guarded(raw: dict) -> dict:
    """``raw`` (a stack's config) with the kit's image on a RunPod pod that has no zone, unless it names one."""
    pod = raw.get("pod")
    if isinstance(pod, dict) and pod.get("provider") == "runpod" and "zone" not in raw and "image" not in pod:
        raw["pod"] = {**pod, "image": GUARDED_IMAGE}
    return raw
