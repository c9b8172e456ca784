"""The pipelined model's pieces that need no process group: weight names both ways, tied embeddings, and the
run's one-line refusals of layouts DeepSpeed's pipeline engine cannot train."""

import pytest

from adaptive.errors import AdaptiveError
from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
from adaptive.models.pipeline import hf_key, pipeline_key
from adaptive.train.run.runplan import World, pipeline_partition, pipeline_zero


@pytest.mark.parametrize("arch, tied", [("dense", False), ("moe", False), ("hybrid", False), ("dense", True)])
def test_every_hf_weight_maps_to_one_stage_key_and_back(arch, tied):
    config = AdaptiveConfig.from_preset("debug", arch=arch, tie_word_embeddings=tied)
    names = list(AdaptiveForCausalLM._from_config(config).state_dict())
    mapped = {name: pipeline_key(name, config) for name in names}
    if tied:  # the head is the embedding, held once by the TiedLayerSpec
        assert mapped.pop("lm_head.weight") is None
        assert mapped["model.embed_tokens.weight"] == "tied_modules.embed.embed_tokens.weight"
    assert len(set(mapped.values())) == len(mapped)  # no two weights share a stage key
    assert {hf_key(key, config) for key in mapped.values()} == set(mapped)
    layers = config.num_hidden_layers
    assert mapped["model.layers.0.self_attn.q_proj.weight"] == "1.layer.self_attn.q_proj.weight"
    assert mapped["model.norm.weight"] == f"{layers + 1}.norm.weight"
    if not tied:
        assert mapped["lm_head.weight"] == f"{layers + 2}.lm_head.weight"


def test_a_name_outside_the_decoder_is_refused():
    config = AdaptiveConfig.from_preset("debug")
    with pytest.raises(AdaptiveError, match="not a weight"):
        pipeline_key("model.rotary.inv_freq", config)


@pytest.mark.parametrize("kwargs, match", [
    (dict(zero=2), r"ZeRO-1 at most.*pipe/engine.py:76"),
    (dict(zero=3), r"ZeRO-1 at most"),
    (dict(tp=2), r"only dense blocks are split inside the pipeline's stages, not moe's"),
    (dict(sp=2), r"deepspeed/__init__.py:583"),
    (dict(ep=4), r"--ep-size 4 with --pp-size 2: .* 2 data-parallel replicas, which 4 does not divide; nearest that does: 2"),
])
def test_layouts_the_pipeline_engine_cannot_train_are_one_line(kwargs, match):
    args = dict(zero=None, sp=1, tp=1, ep=None) | kwargs
    with pytest.raises(AdaptiveError, match=match) as err:
        pipeline_zero(2, args["zero"], args["sp"], args["tp"], args["ep"], "moe", World(4, 4))
    assert "\n" not in str(err.value)


def test_pipeline_zero_stage_and_world():
    assert pipeline_zero(2, None, 1, 1, 2, "moe", World(4, 4)) == 1  # experts split over a stage's two replicas
    assert pipeline_zero(2, None, 1, 1, None, "dense", World(2, 2)) == 0  # one replica: nothing to shard
    assert pipeline_zero(2, None, 1, 1, None, "dense", World(4, 4)) == 1  # ZeRO-1 over the replicas
    assert pipeline_zero(2, 0, 1, 1, None, "dense", World(4, 4)) == 0
    with pytest.raises(AdaptiveError, match="must divide the 3 processes; nearest that does: 1"):
        pipeline_zero(2, None, 1, 1, None, "dense", World(3, 3))


def test_partition_methods():
    assert pipeline_partition("uniform") == "uniform"
    assert pipeline_partition("type:DecoderLayerPipe") == "type:DecoderLayerPipe"
    for bad in ("balanced", "type:", "type:("):
        with pytest.raises(AdaptiveError, match="--pp-partition"):
            pipeline_partition(bad)
