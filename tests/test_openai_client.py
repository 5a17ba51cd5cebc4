"""A real OpenAI Python client (the `openai` package) against the router in workerd:
completions with and without streaming, and clean SDK exceptions for a bad key and a limit."""

import openai
import pytest

from tests.support.workerd import running_cell

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cell():
    with running_cell({"stateTtlMs": 60_000}, compute_ms=1) as c:
        yield c


def client(cell, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=cell.url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_chat_completion_and_models(cell):
    c = client(cell, cell.key)
    done = c.chat.completions.create(model="client/model", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert done.choices[0].message.content and done.usage.total_tokens > 0
    assert [m.id for m in c.models.list()]


def test_streaming_with_usage_is_metered(cell):
    made = cell.create_key("stream", tpm=1)
    c = client(cell, made["key"])
    chunks = list(c.chat.completions.create(model="client/model", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, stream_options={"include_usage": True}, max_tokens=5))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text
    # The pod (as vLLM) reports usage in a final chunk; the router counted it against tpm=1.
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
    with pytest.raises(openai.RateLimitError) as exc:
        c.chat.completions.create(model="client/model", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.type == "tokens"


def test_bad_key_is_an_authentication_error(cell):
    c = client(cell, "clc_" + "x" * 32)
    with pytest.raises(openai.AuthenticationError) as exc:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        list(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True))


def test_over_the_limit_is_a_rate_limit_error(cell):
    made = cell.create_key("limited", rpm=1)
    c = client(cell, made["key"])
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.RateLimitError) as exc:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 429 and exc.value.type == "requests"
    assert int(exc.value.response.headers["retry-after"]) >= 1


def test_routed_answers_carry_openais_rate_limit_headers(cell):
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
    for h in seen:  # OpenAI's duration form: the window is empty again within two minutes
        reset = h["x-ratelimit-reset-requests"]
        minutes, _, seconds = reset.rstrip("s").rpartition("m")
        assert reset.endswith("s") and 0 < int(minutes or 0) * 60 + int(seconds) <= 120, reset
    with pytest.raises(openai.RateLimitError) as exc:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    refused = exc.value.response.headers
    assert refused["x-ratelimit-remaining-requests"] == "0" and 1 <= int(refused["retry-after"]) <= 61
    # a key without limits gets none of them (no limit to pace against)
    unlimited = cell.create_key("unlimited", rpm=0, tpm=0)["key"]
    free = c.with_options(api_key=unlimited).chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}])
    assert not any(name.startswith("x-ratelimit-") for name in free.headers)
