"""RunPod's price is held to ``colocate:pod.maxPricePerHr``: v2's create has no price
field, so the catalogue's list price is checked before renting, and the create's billed ``cost``
after it (a pod above the cap is deleted). Against the fake RunPod, held to the v2 spec."""

from __future__ import annotations

from tests.test_pod_providers import env, fake_runpod, make_spec, run, write_spec  # noqa: F401


def test_a_list_price_above_the_cap_rents_nothing_and_names_the_key(fake_runpod, env, capsys):  # noqa: F811
    fake_runpod.gpu_prices["NVIDIA GeForce RTX 4090"] = {"secure": 0.89, "community": 0.44}
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod"))])
    assert code == 1 and out is None
    assert "$0.89/h" in err and "colocate:pod.maxPricePerHr $0.8/h" in err and "nothing was rented" in err
    assert "pulumi config set --path colocate:pod.maxPricePerHr" in err
    assert fake_runpod.calls("POST", "/v2/pods") == [] and fake_runpod.live() == []


def test_the_list_price_is_per_gpu_so_the_count_multiplies_it(fake_runpod, env, capsys):  # noqa: F811
    code, _, err = run(capsys, ["rent", "--spec", write_spec(env, make_spec("apac-jp", "runpod", gpuCount=2))])
    assert code == 1 and "x2 on SECURE at $1.38/h" in err and fake_runpod.live() == []
    # The cloud's own price: Community lists lower, within the cap.
    code, out, err = run(capsys, ["rent", "--spec", write_spec(env, make_spec("apac-jp", "runpod", gpuCount=2,
                                                                               cloud="COMMUNITY"))])
    assert code == 0 and [p["id"] for p in fake_runpod.live()] == [out["id"]], err


def test_a_billed_cost_above_the_cap_deletes_the_pod_at_once(fake_runpod, env, capsys):  # noqa: F811
    fake_runpod.extra_cost = 0.25  # billed $0.94/h against a list of $0.69/h
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod"))])
    assert code == 1 and out is None
    assert "at $0.94/h, above colocate:pod.maxPricePerHr $0.8/h" in err and "was deleted" in err
    assert len(fake_runpod.calls("POST", "/v2/pods")) == 1  # not tried elsewhere: the price is not the place's
    assert fake_runpod.live() == []


def test_within_the_cap_the_pod_is_rented_at_its_billed_cost(fake_runpod, env, capsys):  # noqa: F811
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod"))])
    assert code == 0 and out["cost_per_hr"] == 0.69, err
