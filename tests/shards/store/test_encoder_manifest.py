"""The embedding model's manifest: read back as written, its architecture's positions checked
(a rotary one names its base, a table one none), a manifest written before rotary encoders
still read."""

from __future__ import annotations

import json

import pytest

from shards.errors import ModelFormatError
from shards.store.encoder_manifest import EncoderManifest
from shards.store.manifest import WeightFile

FIELDS = dict(name="tiny", n_layers=2, hidden_size=32, intermediate_size=64, n_heads=4, vocab_size=40,
              max_positions=64, max_tokens=16, layer_norm_eps=1e-12, pooling="mean", normalize=True,
              files={"weights": WeightFile("encoder.safetensors", 10, "0" * 64)}, source_digest="1" * 64)


def test_a_manifest_reads_back_as_written():
    for manifest in (EncoderManifest(architecture="bert", **FIELDS),
                     EncoderManifest(architecture="nomic_bert", rope_theta=1000.0, **FIELDS)):
        assert EncoderManifest.from_json(manifest.to_json()) == manifest


def test_a_manifest_written_before_rotary_encoders_is_read_as_bert():
    data = json.loads(EncoderManifest(architecture="bert", **FIELDS).to_json())
    del data["rope_theta"]
    assert EncoderManifest.from_json(json.dumps(data)).rope_theta is None


@pytest.mark.parametrize("architecture, rope_theta", [("nomic_bert", None), ("nomic_bert", 0.0),
                                                      ("bert", 1000.0), ("roberta", None)])
def test_positions_that_do_not_fit_the_architecture_are_refused(architecture, rope_theta):
    with pytest.raises(ModelFormatError):
        EncoderManifest(architecture=architecture, rope_theta=rope_theta, **FIELDS)
