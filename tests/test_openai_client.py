"""A real OpenAI Python client (the `openai` package) against the router in workerd:
completions with and without streaming, and clean SDK exceptions for a bad key and a limit."""

import pytest

from tests.support.workerd import running_cell

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cell():
    with running_cell({"stateTtlMs": 60_000}, compute_ms=1) as c:
        yield c


def seconds_of(reset: str) -> int:
    """OpenAI's duration form ("0s", "43s", "1m0s") in seconds."""
    minutes, _, seconds = reset.rstrip("s").rpartition("m")
    assert reset.endswith("s"), reset
    return int(minutes or 0) * 60 + int(seconds)


@pytest.fixture
def client(openai_client):
    """client(cell, key): an openai client of ``cell`` with ``key``, closed after the test."""
    return lambda cell, key: openai_client(cell.url + "/v1", key)


def test_chat_completion_and_models(cell, client):
    c = client(cell, cell.key)
    done = c.chat.completions.create(model="client/model", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert done.choices[0].message.content and done.usage.total_tokens > 0
    assert [m.id for m in c.models.list()]


def test_streaming_with_usage_is_metered(cell, client):
    import openai
    ask = {"model": "client/model", "messages": [{"role": "user", "content": "hi"}], "stream": True,
           "stream_options": {"include_usage": True}, "max_tokens": 5}
    raw = client(cell, cell.key).chat.completions.with_raw_response.create(**ask)
    list(raw.parse())
    # A tpm that admits the request's most (its body's bytes as the client sends it, and max_tokens) and five tokens more.
    made = cell.create_key("stream", tpm=len(raw.http_request.content) + 5 + 5)
    c = client(cell, made["key"])
    chunks = list(c.chat.completions.create(**ask))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text
    # The pod (as vLLM) reports usage in a final chunk (more than 5 tokens); the router counted it
    # against the tpm, so the same request no longer fits beside it.
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 5
    with pytest.raises(openai.RateLimitError) as exc:
        list(c.chat.completions.create(**ask))
    assert exc.value.type == "tokens"


def test_bad_key_is_an_authentication_error(cell, client):
    import openai
    c = client(cell, "clc_" + "x" * 32)
    with pytest.raises(openai.AuthenticationError) as exc:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        list(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True))


def test_over_the_limit_is_a_rate_limit_error(cell, client):
    import openai
    made = cell.create_key("limited", rpm=1)
    c = client(cell, made["key"])
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.RateLimitError) as exc:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 429 and exc.value.type == "requests"
    assert int(exc.value.response.headers["retry-after"]) >= 1


def test_routed_answers_carry_openais_rate_limit_headers(cell, client):
    import openai
    made = cell.create_key("paced", rpm=3, tpm=1_000_000)
    c = client(cell, made["key"])
    seen = []
    for _ in range(3):
        raw = c.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                           max_tokens=5)
        assert raw.parse().choices[0].message.content
        seen.append(raw.headers)
    assert [h["x-ratelimit-limit-requests"] for h in seen] == ["3"] * 3
    assert [h["x-ratelimit-remaining-requests"] for h in seen] == ["2", "1", "0"]  # this request counted
    assert all(h["x-ratelimit-limit-tokens"] == "1000000" for h in seen)
    assert int(seen[0]["x-ratelimit-remaining-tokens"]) > int(seen[2]["x-ratelimit-remaining-tokens"])  # tokens spent
    # OpenAI's duration form: when the window admits the next request (0s while some remains)
    assert [h["x-ratelimit-reset-requests"] == "0s" for h in seen] == [True, True, False]
    assert 0 < seconds_of(seen[2]["x-ratelimit-reset-requests"]) <= 60
    with pytest.raises(openai.RateLimitError) as exc:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    refused = exc.value.response.headers
    assert refused["x-ratelimit-remaining-requests"] == "0" and 1 <= int(refused["retry-after"]) <= 61
    # a key without limits gets none of them (no limit to pace against)
    unlimited = cell.create_key("unlimited", rpm=0, tpm=0)["key"]
    free = c.with_options(api_key=unlimited).chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}])
    assert not any(name.startswith("x-ratelimit-") for name in free.headers)


def test_over_rpm_retry_after_and_the_reset_header_agree_within_a_minute(cell, client):
    """An rpm 2 key over its limit: retry-after and x-ratelimit-reset-requests
    agree within 1 s and neither exceeds 60 s, read through the openai client."""
    import openai

    from tests.support.minutes import fresh_minute

    c = client(cell, cell.create_key("two", rpm=2)["key"])
    fresh_minute(50)  # five calls in one minute, however slow a loaded machine makes them
    for _ in range(2):
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    for _ in range(3):  # refused each time, however far into the minute
        with pytest.raises(openai.RateLimitError) as exc:
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        h = exc.value.response.headers
        retry, reset = int(h["retry-after"]), seconds_of(h["x-ratelimit-reset-requests"])
        assert abs(retry - reset) <= 1 and 1 <= retry <= 60 and reset <= 60, (h["retry-after"], h["x-ratelimit-reset-requests"])
