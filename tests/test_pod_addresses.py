"""A pod's address and name: Vast.ai pods only on static addresses (the DNS
record keeps the address create saw), and each instance reachable under a name of its own, so a
replacement never shares a hostname with its predecessor. Against the fakes, held to the specs."""

from __future__ import annotations

import json

import pytest

from colocate.cell import plan
from colocate.pods import podtls
from colocate.sandbox.localca import LocalCA
from tests.test_pod_providers import env, fake_runpod, fake_vast, make_spec, offer, run, write_spec  # noqa: F401

pytestmark = pytest.mark.slow
BASE = "pod-apac-jp-g1.example.com"


def test_vastai_rents_only_offers_with_a_static_address(fake_vast, env, capsys):  # noqa: F811
    fake_vast.offers = [offer(81, "TW", 0.20, static_ip=False), offer(82, "TW", 0.30)]  # the cheaper one may move
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai"))])
    assert code == 0, err
    assert fake_vast.calls("POST", "/api/v0/bundles")[0]["static_ip"] == {"eq": True}
    assert [path for _, path, _ in fake_vast.log if path.startswith("/api/v0/asks/")] == ["/api/v0/asks/82"]
    # Even when the search drops the filter, a dynamic address is never rented; the table says why.
    fake_vast.ignored_filters = {"static_ip"}
    fake_vast.offers = [offer(83, "TW", 0.20, static_ip=False)]
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai", stack="t2"))])
    assert code == 1 and out is None and "static ip" in err
    assert fake_vast.calls("PUT", "/api/v0/asks/83") == []


def test_a_replacement_gets_a_hostname_its_predecessor_never_had():
    a, b = plan.instance_host(BASE, "vastai", "700001"), plan.instance_host(BASE, "vastai", "700002")
    assert a != b and a.endswith("." + BASE) and b.endswith("." + BASE)
    assert plan.instance_host(BASE, "runpod", "700001") != a  # the provider is part of the instance
    label = a.split(".")[0]
    assert len(label) <= 63 and label[0].isalpha() and label.isalnum()  # a DNS label


@pytest.fixture
def zoned_hop(monkeypatch):
    """A RunPod pod on zone-dns over mutual TLS: its certificate names every instance under the slot."""
    ca = LocalCA.create("test hop CA")
    check_ca = LocalCA.create(f"test {podtls.READINESS_CA}")
    check = check_ca.client("colocate pod readiness")

    def use(cert_names: tuple[str, ...]):
        leaf = ca.server(*cert_names)
        monkeypatch.setenv(podtls.BUNDLE_ENV, podtls.bundle(leaf.cert_pem, leaf.key_pem, ca.cert_pem))
        monkeypatch.setenv(podtls.CHECK_ENV, json.dumps({"cert": check.cert_pem, "key": check.key_pem, "ca": ca.cert_pem}))
    return use


def _zoned_spec(**over) -> dict:
    return {**make_spec("apac-jp", "runpod", hop="auto", readyTimeoutS=3, **over), "path": "zone-dns",
            "tls_name": f"*.{BASE}"}


def test_readiness_checks_the_instances_own_name_under_the_slots_certificate(fake_runpod, env, capsys, zoned_hop):  # noqa: F811
    zoned_hop((f"*.{BASE}",))
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, _zoned_spec())])
    assert code == 0, err
    assert "serving (it refused the readiness certificate" in err  # vLLM's form: it trusts the cell's CA only


def test_a_pod_certified_for_the_slots_bare_name_fails_readiness(fake_runpod, env, capsys, zoned_hop):  # noqa: F811
    zoned_hop((BASE,))  # what a pod of the previous kit carried: one name for every instance of the slot
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, _zoned_spec())])
    assert code == 1 and out is None and fake_runpod.live() == []
    assert f"not the cell's for {plan.instance_label('runpod', fake_runpod.pods.popitem()[0])}.{BASE}" in err
