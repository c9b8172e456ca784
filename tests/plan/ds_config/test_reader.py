"""The one reader of a user's DeepSpeed JSON: the knobs its explicit values pin, layout included, for fit and
the recipes alike."""

from __future__ import annotations

import pytest

from adaptive.plan.ds_config.reader import merge_parallel_pins, parse, pins


def test_pins_are_the_explicit_values_and_auto_pins_nothing():
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto", "gradient_clipping": 0.5,
           "bf16": {"enabled": True}, "sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 0},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "zero_hpz_partition_size": 4,
                                 "zero_quantized_weights": "auto", "zero_quantized_gradients": True}}
    assert pins(cfg) == {"zero": 3, "offload": "optimizer", "micro_batch": 2, "clipping": 0.5, "precision": "bf16",
                         "sp_size": 2, "tp_size": 1, "zero_hpz": 4, "zero_quantize": "gradients"}
    assert pins({"zero_optimization": {"stage": "auto"}, "sequence_parallel_size": "auto"}) == {}


@pytest.mark.parametrize("weights, gradients, name", [(True, True, "both"), (True, False, "weights"),
                                                      (False, True, "gradients"), (False, False, "off")])
def test_fit_and_the_recipes_read_the_same_zero_plus_plus_switches(weights, gradients, name):
    cfg = {"zero_optimization": {"stage": 3, "zero_quantized_weights": weights, "zero_quantized_gradients": gradients}}
    assert pins(cfg)["zero_quantize"] == name  # the recipes
    assert merge_parallel_pins(parse(cfg, "ds.json", 64), None, None, None, None)[3] == name  # fit
