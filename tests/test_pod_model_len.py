"""colocate:pod.maxModelLen: the pods' context is a setting, validated with the key, the value and
the fix, and it flows to vLLM's arguments, the Worker's MAX_MODEL_LEN (the router's ceilings), the
stand-in and the pod's name; vLLM is given the model positionally (its --model is deprecated)."""

from __future__ import annotations

import dataclasses
import http.client
import json

import pytest

from colocate.cell import plan, settings
from colocate.errors import ConfigError
from colocate.pods import profiles, standin
from colocate.pods.spec import PodSpec
from tests.test_plan import SECRETS, raw_for


def cell(**pod):
    raw = raw_for()
    raw["pod"] = {**raw["pod"], **pod}
    return plan.plan_cell(settings.parse(raw, "t", secrets=SECRETS))


def max_model_len_binding(cell_plan) -> str:
    return next(b.text for b in cell_plan.worker.bindings if b.name == "MAX_MODEL_LEN")


def test_the_default_context_is_8192_and_leaves_the_pods_names_as_they_were():
    default, spelled = cell(), cell(maxModelLen=8192)
    assert max_model_len_binding(default) == "8192" and default.pod.spec()["max_model_len"] == 8192
    assert default.pod.name == spelled.pod.name  # no pod of an existing stack is replaced by the key's arrival


def test_a_longer_context_reaches_vllm_the_worker_and_the_pods_name():
    longer, default = cell(maxModelLen="32768"), cell()
    args = PodSpec.from_dict(longer.pod.spec()).vllm_args()
    assert args[args.index("--max-model-len") + 1] == "32768" == max_model_len_binding(longer)
    assert longer.pod.name != default.pod.name  # a pod cannot change its context while it runs: a new one


def test_vllm_gets_the_model_positionally():
    spec = PodSpec.from_dict(cell().pod.spec())
    args = spec.vllm_args()
    assert args[0] == spec.model == "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4" and "--model" not in args
    assert args[1:] == spec.serve_args("0.0.0.0", spec.port)


@pytest.mark.parametrize("value", [0, 15, 131073, "8k", 8192.5, True, None])
def test_a_bad_context_is_refused_naming_the_key_the_value_and_the_fix(value):
    with pytest.raises(ConfigError) as err:
        cell(maxModelLen=value)
    text = str(err.value)
    assert "colocate:pod.maxModelLen" in text and repr(value) in text and "pulumi config set --path" in text


def test_a_spec_of_an_older_kit_without_the_key_means_8192():
    spec = cell().pod.spec()
    for key in ("max_model_len", "command", "url"):
        del spec[key]
    assert PodSpec.from_dict(spec).max_model_len == 8192


def test_the_stand_in_serves_the_context_it_is_given():
    short = dataclasses.replace(profiles.get("oracle"), max_model_len=1024)
    with standin.serve(compute_ms=0, token="t", profile=short, log=lambda _l: None) as pod:
        conn = http.client.HTTPConnection("127.0.0.1", pod.port, timeout=10)
        body = {"model": standin.DEFAULT_MODEL, "prompt": "hi", "max_tokens": 2000}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": "Bearer t",
                                                                   "Content-Type": "application/json"})
        res = conn.getresponse()
        answer = json.loads(res.read())
        conn.close()
    # vLLM's own refusal of a limit past the context (tests/engine_contract checks the words against vLLM)
    assert res.status == 400 and "cannot be greater than max_model_len=1024" in answer["error"]["message"], answer
