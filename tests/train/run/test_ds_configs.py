"""ds_configs/*.json are exactly what the planner's emitter writes, accelerate and DeepSpeed accept each of them
once its "auto" values are filled, and MoE is refused on the ZeRO-3 ones. (The MoE-safe preset trains a real
two-process expert-parallel run in test_recipes.py.)"""

from __future__ import annotations

import json

import pytest

from adaptive.errors import AdaptiveError
from adaptive.plan.ds_config.emit import PRESET_DS_CONFIGS, preset_ds_configs
from adaptive.config.commandline import parse
from adaptive.plan.ds_config.reader import pins as file_pins
from adaptive.train.run.runplan import Device, World, plan_run
from tests.train._launch import REPO
from tests._deepspeed_config import DataParallel, single_process_group  # noqa: F401 (fixture)

FOLDER = REPO / "ds_configs"
NAMES = ["zero0", "zero1", "zero2", "zero3", "zero2_offload_optimizer", "zero3_offload_optimizer",
         "zero3_offload_all", "zero2_moe"]


def test_checked_in_files_are_what_the_emitter_writes():
    assert sorted(p.stem for p in FOLDER.glob("*.json")) == sorted(NAMES) == sorted(PRESET_DS_CONFIGS)
    for name, cfg in preset_ds_configs().items():
        assert (FOLDER / f"{name}.json").read_text() == json.dumps(cfg, indent=2) + "\n", \
            f"ds_configs/{name}.json is stale: run python ds_configs/generate.py"


def test_each_preset_says_what_its_name_says():
    for name in NAMES:
        cfg = json.loads((FOLDER / f"{name}.json").read_text())
        pins = file_pins(cfg)
        assert pins["zero"] == int(name[4])
        assert pins.get("offload", "none") == ("all" if "offload_all" in name else
                                               "optimizer" if "offload_optimizer" in name else "none")
        assert "micro_batch" not in pins and "precision" not in pins  # left "auto"
        assert cfg["bf16"]["enabled"] == cfg["fp16"]["enabled"] == "auto"
    assert json.loads((FOLDER / "zero3.json").read_text())["zero_optimization"][
        "stage3_gather_16bit_weights_on_model_save"] is True  # the HF export consolidates ZeRO-3 weights


@pytest.mark.parametrize("name", NAMES)
def test_accelerate_and_deepspeed_accept_each_preset(name, single_process_group):
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.config import DeepSpeedConfig

    path = FOLDER / f"{name}.json"
    plugin = DeepSpeedPlugin(hf_ds_config=str(path))  # accelerate reads it as a user's file
    plugin.set_mixed_precision("bf16")
    assert plugin.deepspeed_config["bf16"]["enabled"] is True and plugin.deepspeed_config["fp16"]["enabled"] is False
    assert plugin.zero_stage == int(name[4])
    arch = "moe" if "moe" in name else "dense"
    run = plan_run(parse("train", ["--ds-config", str(path)]), "b1", arch, World(8, 8), Device("cuda", _a100()), {})
    assert "auto" not in json.dumps(run.ds_config)
    parsed = DeepSpeedConfig(run.ds_config, mpu=DataParallel(8))
    assert parsed.zero_optimization_stage == int(name[4]) and parsed.bfloat16_config.enabled
    assert parsed.train_micro_batch_size_per_gpu == run.knobs.micro_batch_size


def test_moe_is_refused_on_zero_3():
    for name in ("zero3", "zero3_offload_all"):
        with pytest.raises(AdaptiveError, match="impossible for MoE"):
            plan_run(parse("train", ["--ds-config", str(FOLDER / f"{name}.json")]), "b1", "moe", World(8, 8),
                     Device("cuda", _a100()), {})


def _a100():
    from adaptive.plan import get_gpu

    return get_gpu("a100-80gb")
