"""What a cell costs against the fallback API, from what the providers reported and the keys' usage.

Pure: no I/O, no Pulumi. ``scripts/cost.py`` gathers the inputs:

    cost_per_hr      the cell's pods together, $/hr (the stack's ``podsCostPerHr`` output, what
                     the providers reported when the pods were created)
    hours            how long the pods ran within the window
    usage rows       ``GET /_colocate/usage`` rows: per key and day, requests, prompt and
                     completion tokens, and how many requests the pods and the fallback served
    price            ``colocate:fallbackPrice``: $ per 1M input and output tokens at the fallback
    caps             ``colocate:fallbackCap``: the fallback's daily spend caps (cell, each key), $

A usage row counts tokens per key and day, not per backend, and what the fallback's answers
cost at the cell's price (``fallback_microusd``, counted by the Worker from each answer's usage,
the figure its caps hold). The fallback's own spend is that count. A row's tokens are split
between pods and fallback so that the fallback's share costs what the Worker counted (exact when
a key's requests of a day all went one way, the common case; the prompt/completion mix an
estimate otherwise, and said so); by requests where the Worker counted nothing (no price set
when it served, or another price given here).

The answers: the pods' cost over the window; tokens and requests by pods and by fallback;
the pods' cost per 1M tokens; what the pods' tokens would have cost at the fallback's
price; the fallback's own spend, and today's as the Worker counted it against the caps; the
break-even volume (tokens/day from which the cell is cheaper than sending everything to the
API, at the window's input/output mix); and, given a capacity, the pods' utilisation: their
requests against it, or, when the capacity says how large its requests were (a profile's knee:
256 tokens in, about 100 out), their tokens against its tokens, since a pod fills with tokens,
not requests (a 5,000-token prompt is fourteen of the knee's requests). When the fallback served a
large share of the requests of pods that were far from full, the report says so: the fallback was
then bought for another reason than capacity (a pod down, deadlines missed).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..errors import ScriptError

HOURS_PER_MONTH = 730.0  # 365 x 24 / 12, the providers' own monthly figure
# The shortest window scaled to tokens per day: a day is 24 hours of traffic, and less than an
# hour of it (a sandbox up for minutes, a burst of tests) says nothing about the rest of the day.
MIN_SCALE_HOURS = 1.0
DAYS_PER_MONTH = HOURS_PER_MONTH / 24
MILLION = 1_000_000
# Past this share of requests to the fallback while the pods were under half full, the report
# says the fallback was not bought for want of capacity (the probe's maxFallbackShare default).
FALLBACK_SHARE_NOTE = 0.10


@dataclass(frozen=True)
class Price:
    """$ per 1M tokens at the fallback API."""

    input: float
    output: float

    def of(self, prompt: float, completion: float) -> float:
        return (prompt * self.input + completion * self.output) / MILLION

    def blended(self, prompt: float, completion: float) -> float:
        """$ per 1M tokens at this input/output mix (1:1 when there were no tokens)."""
        if prompt + completion <= 0:
            return (self.input + self.output) / 2
        return self.of(prompt, completion) * MILLION / (prompt + completion)

    def to_json(self) -> dict:
        return {"input": self.input, "output": self.output}


@dataclass(frozen=True)
class Served:
    requests: int = 0
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0

    @property
    def tokens(self) -> float:
        return self.prompt_tokens + self.completion_tokens

    def to_json(self) -> dict:
        return {"requests": self.requests, "prompt_tokens": round(self.prompt_tokens),
                "completion_tokens": round(self.completion_tokens), "tokens": round(self.tokens)}


def duration(hours: float) -> str:
    """``52 s``, ``3 min 12 s``, ``2 h 5 min``, ``3.5 days``: a duration as a person reads it."""
    seconds = max(0.0, hours * 3600)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        m, s = divmod(round(seconds), 60)
        return f"{m} min {s} s" if s else f"{m} min"
    if seconds < 2 * 86_400:
        h, m = divmod(round(seconds / 60), 60)
        return f"{h} h {m} min" if m else f"{h} h"
    return f"{seconds / 86_400:,.3g} days"


class UsageError(ScriptError, ValueError):
    """A usage row lacks a field or holds a negative number (names the row and field); exit 2."""

    exit_code = 2


def dollars(usd: float) -> str:
    """``$1,234.50``, ``$0.02``; under a cent, the digits that say it: ``$0.001``, ``$0.000004``."""
    if usd == 0 or abs(usd) >= 0.01:
        return f"${usd:,.2f}"
    places = -math.floor(math.log10(abs(usd))) + 1  # two significant digits
    return "$" + f"{usd:.{places}f}".rstrip("0")


def counted_spend(rows: Iterable[Mapping]) -> float | None:
    """The fallback's spend the Worker counted over ``rows`` (their ``fallback_microusd``), in $;
    None when no row carries it (a Worker that does not count it)."""
    counted = [r.get("fallback_microusd") for r in rows]
    ok = [v for v in counted if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return sum(ok) / MILLION if ok else None


def split_usage(rows: Iterable[Mapping], price: Price | None = None) -> tuple[Served, Served, list[str], dict[str, float]]:
    """(by pods, by fallback, notes, tokens per day) from usage rows. With ``price`` (the one the
    Worker counted ``fallback_microusd`` at), a row's fallback share of its tokens is the share of
    their cost at that price the Worker counted for the fallback; else its share of the requests."""
    pod = [0, 0.0, 0.0]
    fb = [0, 0.0, 0.0]
    mixed = by_cost = 0
    per_day: dict[str, float] = {}
    for i, r in enumerate(rows):
        vals = {}
        for f in ("requests", "prompt_tokens", "completion_tokens", "pod_requests", "fallback_requests"):
            v = r.get(f, 0)
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0 or not math.isfinite(v):
                raise UsageError(f"usage row {i} ({r.get('day')}, {r.get('key_id')}): {f} is {v!r}, not a count")
            vals[f] = v
        served = vals["pod_requests"] + vals["fallback_requests"]
        share = vals["pod_requests"] / served if served else 1.0  # tokens without a served request: none, in practice
        spent = r.get("fallback_microusd")
        whole = price.of(vals["prompt_tokens"], vals["completion_tokens"]) * MILLION if price else 0.0
        if 0 < share < 1 and whole > 0 and isinstance(spent, int) and not isinstance(spent, bool) and spent > 0:
            # The Worker rounds each answer's cost up to a millionth of a dollar: never past the whole.
            share = 1 - min(1.0, spent / whole)
            by_cost += 1
        if 0 < vals["pod_requests"] < served:
            mixed += 1
        for acc, s in ((pod, share), (fb, 1 - share)):
            acc[1] += vals["prompt_tokens"] * s
            acc[2] += vals["completion_tokens"] * s
        pod[0] += vals["pod_requests"]
        fb[0] += vals["fallback_requests"]
        day = str(r.get("day"))
        per_day[day] = per_day.get(day, 0.0) + vals["prompt_tokens"] + vals["completion_tokens"]
    notes = []
    if by_cost:
        notes.append(f"{by_cost} key-days were served partly by the fallback: their tokens are split between pods "
                     "and fallback so that the fallback's part costs what the Worker counted for its answers (usage "
                     "rows count tokens per key and day, not per backend)")
    if mixed - by_cost:
        notes.append(f"{mixed - by_cost} key-days were served partly by the fallback: their tokens are split between pods "
                     "and fallback by requests (usage rows count tokens per key and day, not per backend)")
    return Served(pod[0], pod[1], pod[2]), Served(fb[0], fb[1], fb[2]), notes, per_day


@dataclass
class CostReport:
    window_days: float
    hours: float
    cost_per_hr: float
    cost_source: str
    price: Price | None
    pods: Served
    fallback: Served
    pods_cost: float
    pods_cost_per_m: float | None
    pods_tokens_at_fallback_price: float | None
    fallback_spend: float | None
    saving: float | None
    tokens_per_day: float | None  # None: the window is shorter than MIN_SCALE_HOURS
    today_tokens: float | None
    break_even_tokens_per_day: float | None
    monthly_cell_cost: float
    monthly_api_cost_at_volume: float | None
    blended_price_per_m: float | None
    utilisation: float | None
    capacity_rpm: float | None
    capacity_tokens_per_request: float | None  # the capacity's request size: utilisation in tokens
    pod_count: int
    notes: list[str] = field(default_factory=list)
    # Today's fallback spend as the Worker counted it (usage rows' fallback_microusd), the
    # cell's and its highest key's, and the caps it is held to (0: none); None: not counted.
    today_fallback_spend: float | None = None
    today_top_key_spend: float | None = None
    caps: tuple[float, float] = (0.0, 0.0)

    @property
    def cheaper(self) -> str | None:
        if self.break_even_tokens_per_day is None or self.tokens_per_day is None:
            return None
        return "cell" if self.tokens_per_day >= self.break_even_tokens_per_day else "api"

    @property
    def too_short(self) -> str:
        return (f"{duration(self.hours)} of traffic is too short to scale to a day (at least "
                f"{duration(MIN_SCALE_HOURS)}): run it again after {duration(MIN_SCALE_HOURS)} of traffic, or pass "
                "--hours if the pods ran longer")

    def verdict(self) -> str:
        if self.price is None:
            return (f"pods cost ${self.pods_cost:,.2f} over {duration(self.hours)} for {self.pods.tokens:,.0f} tokens; "
                    "set colocate:fallbackPrice to compare with the API")
        be = self.break_even_tokens_per_day
        if self.tokens_per_day is None:
            return f"the cell pays off from {be:,.0f} tokens/day; which is cheaper now is not known: {self.too_short}"
        now = f"{self.tokens_per_day:,.0f} tokens/day"
        if self.cheaper == "cell":
            return f"the cell is cheaper than the API at {now} (break-even {be:,.0f} tokens/day)"
        return (f"the API would be cheaper at {now}: the cell pays off from {be:,.0f} tokens/day "
                f"({be / max(self.tokens_per_day, 1):,.1f}x today's volume)")


def report(rows: Iterable[Mapping], *, cost_per_hr: float, hours: float, window_days: float,
           price: Price | None, cost_source: str = "podsCostPerHr", pod_count: int = 1,
           capacity_rpm: float | None = None, today: str | None = None,
           caps: tuple[float, float] = (0.0, 0.0), price_counted: bool = True,
           capacity_tokens_per_request: float | None = None) -> CostReport:
    """The cost report of one window (see the module docstring). ``price_counted``: ``price`` is
    the one the Worker counted the fallback's spend at (the stack's colocate:fallbackPrice), so
    its count is the fallback's spend; False for another price (``--price``): spend at that price."""
    if not (math.isfinite(cost_per_hr) and cost_per_hr >= 0):
        raise ValueError(f"cost_per_hr {cost_per_hr!r}: must be a number of $/hr >= 0")
    if not (math.isfinite(hours) and hours >= 0) or not window_days > 0:
        raise ValueError(f"hours {hours!r} / window_days {window_days!r}: must be >= 0 / > 0")
    rows = list(rows)
    pods, fb, notes, per_day = split_usage(rows, price if price_counted else None)
    spent_today, top_key = today_spend(rows, today)
    pods_cost = cost_per_hr * hours
    per_m = pods_cost / pods.tokens * MILLION if pods.tokens > 0 else None
    at_price = price.of(pods.prompt_tokens, pods.completion_tokens) if price else None
    counted = counted_spend(rows) if price and price_counted else None
    fb_spend = counted if counted is not None else price.of(fb.prompt_tokens, fb.completion_tokens) if price else None
    all_prompt = pods.prompt_tokens + fb.prompt_tokens
    all_completion = pods.completion_tokens + fb.completion_tokens
    blended = price.blended(all_prompt, all_completion) if price else None
    if price and all_prompt + all_completion <= 0:
        notes.append("no tokens in the window: the break-even assumes as many input as output tokens")
    per_day_cell = cost_per_hr * 24
    break_even = per_day_cell / blended * MILLION if blended else None
    scalable = hours >= MIN_SCALE_HOURS
    tokens_per_day = (pods.tokens + fb.tokens) / window_days if scalable else None
    monthly_api = tokens_per_day * DAYS_PER_MONTH * blended / MILLION if blended is not None and scalable else None
    util = None
    if capacity_rpm:
        could = capacity_rpm * 60 * hours * max(pod_count, 1)
        if capacity_tokens_per_request:
            could *= capacity_tokens_per_request
        did = pods.tokens if capacity_tokens_per_request else pods.requests
        util = did / could if could > 0 else None
    served = pods.requests + fb.requests
    if util is not None and served and fb.requests / served > FALLBACK_SHARE_NOTE and util < 0.5:
        notes.append(f"the fallback served {fb.requests / served:.0%} of the requests while the pods were "
                     f"{util:.0%} busy over {duration(hours)}: not for want of capacity on average (a pod down or "
                     "out of rotation, deadlines missed, or a burst the pods could not take: scripts/probe.py "
                     "--live shows which)")
    if price is None:
        notes.append("colocate:fallbackPrice is not set: no comparison with the API "
                     "(pulumi config set --path colocate:fallbackPrice.input 0.15, and .output)")
    return CostReport(
        window_days=window_days, hours=hours, cost_per_hr=cost_per_hr, cost_source=cost_source, price=price,
        pods=pods, fallback=fb, pods_cost=pods_cost, pods_cost_per_m=per_m, pods_tokens_at_fallback_price=at_price,
        fallback_spend=fb_spend, saving=None if at_price is None else at_price - pods_cost,
        tokens_per_day=tokens_per_day, today_tokens=per_day.get(today) if today else None,
        break_even_tokens_per_day=break_even, monthly_cell_cost=cost_per_hr * HOURS_PER_MONTH,
        monthly_api_cost_at_volume=monthly_api, blended_price_per_m=blended, utilisation=util,
        capacity_rpm=capacity_rpm, capacity_tokens_per_request=capacity_tokens_per_request, pod_count=pod_count,
        notes=notes,
        today_fallback_spend=spent_today, today_top_key_spend=top_key, caps=caps,
    )


def today_spend(rows: list[Mapping], today: str | None) -> tuple[float | None, float | None]:
    """(the cell's, its highest key's) fallback spend on ``today`` in $, from the rows'
    ``fallback_microusd``; (None, None) when no row of today carries it (a Worker that does not count it)."""
    spent = [r.get("fallback_microusd") for r in rows if today is not None and r.get("day") == today]
    counted = [v for v in spent if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    if not counted:
        return None, None
    return sum(counted) / MILLION, max(counted) / MILLION


def to_json(r: CostReport) -> dict:
    return {
        "verdict": r.verdict(), "cheaper": r.cheaper,
        "window_days": r.window_days, "hours": round(r.hours, 3),
        "cost_per_hr": r.cost_per_hr, "cost_source": r.cost_source, "pod_count": r.pod_count,
        "fallback_price_per_m": r.price.to_json() if r.price else None,
        "pods": r.pods.to_json(), "fallback": r.fallback.to_json(),
        "pods_cost": round(r.pods_cost, 4),
        "pods_cost_per_m_tokens": _r(r.pods_cost_per_m),
        "pods_tokens_at_fallback_price": _r(r.pods_tokens_at_fallback_price),
        "fallback_spend": _r(r.fallback_spend), "saving": _r(r.saving),
        "tokens_per_day": None if r.tokens_per_day is None else round(r.tokens_per_day), "today_tokens": r.today_tokens,
        "min_scale_hours": MIN_SCALE_HOURS,
        "break_even_tokens_per_day": None if r.break_even_tokens_per_day is None else round(r.break_even_tokens_per_day),
        "monthly_cell_cost": round(r.monthly_cell_cost, 2),
        "monthly_api_cost_at_volume": _r(r.monthly_api_cost_at_volume),
        "blended_price_per_m": _r(r.blended_price_per_m),
        "capacity_rpm": r.capacity_rpm, "capacity_tokens_per_request": r.capacity_tokens_per_request,
        "utilisation": None if r.utilisation is None else round(r.utilisation, 6),
        "fallback_spend_today": _r(r.today_fallback_spend), "fallback_top_key_spend_today": _r(r.today_top_key_spend),
        "fallback_cap_cell_per_day": r.caps[0] or None, "fallback_cap_key_per_day": r.caps[1] or None,
        "notes": r.notes,
    }


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def _money(v: float | None) -> str:
    return "n/a" if v is None else dollars(v)


def _capacity(r: CostReport) -> str:
    if not r.capacity_tokens_per_request:
        return f"{r.capacity_rpm:g} req/min"
    return (f"{r.capacity_rpm * r.capacity_tokens_per_request:,.0f} tokens/min ({r.capacity_rpm:g} req/min of "
            f"{r.capacity_tokens_per_request:,.0f} tokens)")


def _cap(usd: float) -> str:
    return f"{dollars(usd)} a day" if usd > 0 else "no cap"


def table(r: CostReport) -> str:
    price = (f"${r.price.input:g} in / ${r.price.output:g} out per 1M tokens" if r.price else "not set")
    lines = [
        f"cell cost over {duration(r.window_days * 24)}",
        f"  pods              {_money(r.pods_cost)} = ${r.cost_per_hr:,.4g}/hr x {duration(r.hours)} ({r.cost_source})",
        f"  served by pods    {r.pods.requests:>12,} requests {r.pods.tokens:>14,.0f} tokens",
        f"  served by fallbk  {r.fallback.requests:>12,} requests {r.fallback.tokens:>14,.0f} tokens",
        f"  pods' cost per 1M tokens      {_money(r.pods_cost_per_m)}",
        f"  fallback price                {price}",
        f"  pods' tokens at that price    {_money(r.pods_tokens_at_fallback_price)}"
        + (f"  (the cell {'saved' if r.saving >= 0 else 'cost'} {_money(abs(r.saving))}"
           f"{'' if r.saving >= 0 else ' more'})" if r.saving is not None else ""),
        f"  fallback's own spend          {_money(r.fallback_spend)}",
        f"  fallback today (UTC)          {_money(r.today_fallback_spend)} of {_cap(r.caps[0])} (cell); "
        f"highest key {_money(r.today_top_key_spend)} of {_cap(r.caps[1])}",
        "  volume                        " + (f"{r.tokens_per_day:,.0f} tokens/day" if r.tokens_per_day is not None
                                               else f"not scaled: {r.too_short}"),
        "  break-even                    " + ("n/a" if r.break_even_tokens_per_day is None
                                               else f"{r.break_even_tokens_per_day:,.0f} tokens/day"),
        f"  per month                     cell {_money(r.monthly_cell_cost)} flat; API at this volume "
        f"{_money(r.monthly_api_cost_at_volume)}",
        "  utilisation                   " + ("n/a (pass --capacity-rpm: requests/min one pod can serve)"
                                              if r.utilisation is None
                                              else f"{r.utilisation:.2%} of {_capacity(r)} x {r.pod_count} pods"),
    ]
    if r.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in r.notes]
    lines += ["", r.verdict()]
    return "\n".join(lines) + "\n"


def plot(r: CostReport, path) -> None:
    """Monthly cost against daily volume, both axes logarithmic so that a small volume and the
    break-even both show: the cell flat, the API a straight line, the break-even and this
    window's volume marked (matplotlib, Agg)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    be = r.break_even_tokens_per_day
    now = r.tokens_per_day if r.tokens_per_day else None
    marks = [v for v in (be, now) if v]
    low = 10 ** math.floor(math.log10(min(marks) / 10)) if marks else 1e3
    high = 10 ** math.ceil(math.log10(max(marks) * 10)) if marks else 1e9
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    try:
        xs = [low, high]
        ax.plot(xs, [r.monthly_cell_cost] * 2, color="tab:blue", linewidth=2,
                label=f"cell: ${r.cost_per_hr:,.3g}/hr x {HOURS_PER_MONTH:g} h = ${r.monthly_cell_cost:,.0f}/month")
        if r.blended_price_per_m is not None:
            ax.plot(xs, [x * DAYS_PER_MONTH * r.blended_price_per_m / MILLION for x in xs], color="tab:orange",
                    linewidth=2, label=f"API at ${r.blended_price_per_m:,.3g} per 1M tokens (this mix)")
        if be is not None:
            ax.axvline(be, color="gray", linestyle="dashed", linewidth=1, label=f"break-even: {be:,.0f} tokens/day")
        if now is not None:
            ax.axvline(now, color="tab:green", linewidth=2,
                       label=f"this window ({duration(r.hours)}): {now:,.0f} tokens/day")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(low, high)
        ax.set_xlabel("tokens per day (log)")
        ax.set_ylabel("$ per month (log)")
        title = r.verdict() if now is not None else r.verdict().split(":")[0] + ": " + \
            f"{duration(r.hours)} of traffic is too short to place on this chart (at least {duration(MIN_SCALE_HOURS)})"
        ax.set_title("\n".join(textwrap.wrap(title.replace("$", r"\$"), 90)), fontsize=9)
        for line in ax.get_lines():  # "$" starts matplotlib's mathtext: show the dollars as written
            line.set_label(line.get_label().replace("$", r"\$"))
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3, which="both")
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
