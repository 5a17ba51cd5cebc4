"""colocate:worker.contentParts: the chat content parts a cell may pass to its pods besides text,
validated with the key, the value and the fix, and bound as CONTENT_PARTS (worker/src/podfields.js,
docs/worker.md "What the pods are sent"). The Worker's side runs in workerd in tests/test_security.py."""

import json

import pytest

from colocate.errors import ConfigError
from tests.support.workerd import cell_plan


def bindings(p) -> dict:
    return {b.name: b.text for b in p.worker.bindings if b.type == "plain_text"}


def test_text_only_unless_the_operator_names_media_parts():
    assert "CONTENT_PARTS" not in bindings(cell_plan())
    got = bindings(cell_plan(worker={"contentParts": ["image_url", "input_audio", "image_url"]}))
    assert json.loads(got["CONTENT_PARTS"]) == ["image_url", "input_audio"]


@pytest.mark.parametrize("value", ["image_url", ["image_embeds"], ["prompt_embeds"], [1]])
def test_a_part_type_the_kit_never_passes_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"colocate:worker\.contentParts: .*image_url, input_audio, audio_url, video_url"):
        cell_plan(worker={"contentParts": value})
