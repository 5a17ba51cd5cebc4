"""What one pod can do, as the scaling policy, ``demo-autoscale`` and ``cost.py`` assume it: its
capacity (the knee of its GPU+model profile) and its boot time. Pure: no I/O.

* ``pod_capacity(profile)``: requests per minute one pod serves while its TTFT p99 stays within
  the capacity planner's budget (``profiles.DEFAULT_TTFT_P99_BUDGET_MS``): the profile's
  ``knee_rps`` (the stand-in's engine in virtual time, a minute of Poisson arrivals of 256-token
  prompts, answers of at most 128: ~100 on average, the median pace held to the router's 25
  tokens/s) when it has one, else the highest rate of the profile's published sweeps within that
  budget. Answers longer than that take more of a pod: ``knee_request_tokens(profile)`` is the size of
  the knee's requests, for a utilisation counted in tokens (``colocate/scaling/cost.py``).
* ``BOOT_S``: from create to the first token on a fresh host, 20 minutes: the pinned
  ``vllm/vllm-openai:*-cu129`` image is ~11 GB compressed, the weights ~5 GB, and operators
  report 15 to 20 minutes (the fourth real-cloud review, 2026-12). The longer end, because a
  pod that boots slower than planned is a pod paid for and not yet serving.
  ``colocate:pod.readyTimeoutS`` (1,800 s by default) covers it with room for a slow pull.
"""

from __future__ import annotations

from ..errors import NoCapacity
from ..pods import profiles

BOOT_S = 20 * 60
BOOT_SOURCE = "~11 GB image + ~5 GB weights: operators report 15-20 min from create to a first token on a fresh host"
DEFAULT_PROFILE = profiles.DEFAULT_PROFILE
_FIX = ("name a profile with a knee in colocate:pod.profile (" + ", ".join(n for n in profiles.PROFILES if n != "oracle")
        + "), or set colocate:scale.target yourself")


def sweep_knee_rps(profile: profiles.Profile, budget_ms: float = profiles.DEFAULT_TTFT_P99_BUDGET_MS) -> float | None:
    """The highest request rate of the profile's published sweeps whose TTFT p99 is within ``budget_ms``."""
    within = [p.req_s for s in profile.sweeps for p in s.points if p.ttft_p99_ms is not None and p.ttft_p99_ms <= budget_ms]
    return max(within) if within else None


def knee_rps(profile_name: str = DEFAULT_PROFILE) -> tuple[float, str]:
    """(requests/s at the knee, where the figure comes from) for ``profile_name``."""
    try:
        p = profiles.get(profile_name)
    except ValueError as err:
        raise NoCapacity(profile_name, str(err), _FIX) from None
    if p.knee_rps > 0:
        return p.knee_rps, f"{p.name}: knee of the stand-in's engine (profiles.knee_rps)"
    knee = sweep_knee_rps(p)
    if knee is None:
        raise NoCapacity(p.name, "this pod profile has no knee: it models no limit (oracle) or no sweep", _FIX)
    return knee, (f"{p.name}: the highest rate of its published sweep with TTFT p99 within "
                  f"{profiles.DEFAULT_TTFT_P99_BUDGET_MS:g} ms")


def knee_request_tokens(profile_name: str = DEFAULT_PROFILE) -> float | None:
    """A request of the knee's workload in tokens, prompt and mean answer (256 + ~100 on the default
    profile); None when the knee is a published sweep's (its requests are the sweep's)."""
    p = profiles.get(profile_name)
    if p.knee_rps <= 0:
        return None
    return profiles.KNEE_INPUT_TOKENS + p.answer_mean_tokens(profiles.KNEE_OUTPUT_TOKENS)


def pod_capacity(profile_name: str = DEFAULT_PROFILE) -> float:
    """Requests per minute one pod of ``profile_name`` serves within budget (its knee x 60)."""
    return round(knee_rps(profile_name)[0] * 60, 1)
