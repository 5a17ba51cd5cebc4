"""colocate:fallbackFields: the request fields the fallback may receive beyond the Worker's
allowlist, validated with the key, the value and the fix, and bound as FALLBACK_FIELDS;
the pods' context bound as MAX_MODEL_LEN (what a request may cost, docs/worker.md)."""

import json

import pytest

from colocate.cell import plan, settings
from colocate.errors import ConfigError
from colocate.pods.spec import PodSpec
from tests.support.workerd import cell_plan


def test_fallback_fields_are_field_names_and_each_bad_one_is_named():
    assert settings.parse_fallback_fields(None) == ()
    assert settings.parse_fallback_fields(["store", "metadata", "store"]) == ("store", "metadata")
    with pytest.raises(ConfigError, match=r"colocate:fallbackFields: .*must be a list of request field names.*\[0\]"):
        settings.parse_fallback_fields("store")
    with pytest.raises(ConfigError, match=r"colocate:fallbackFields\[1\]: .*'service tier'.*field name"):
        settings.parse_fallback_fields(["store", "service tier"])


def bindings(p) -> dict:
    return {b.name: b.text for b in p.worker.bindings if b.type == "plain_text"}


def test_the_worker_is_bound_the_fields_and_the_pods_context():
    plain = bindings(cell_plan())
    assert "FALLBACK_FIELDS" not in plain  # none allowed: the Worker's allowlist alone
    assert plain["MAX_MODEL_LEN"] == str(plan.MAX_MODEL_LEN) == "8192"
    allowed = bindings(cell_plan(fallbackFields=["store", "metadata"]))
    assert json.loads(allowed["FALLBACK_FIELDS"]) == ["store", "metadata"]
    # the pods serve the context the Worker bounds requests by
    args = PodSpec.from_dict(cell_plan().pod.spec()).vllm_args()
    assert args[args.index("--max-model-len") + 1] == plain["MAX_MODEL_LEN"]
