"""Tensor parallelism inside the pipeline's stages, the parts that need no process group: which linears DeepSpeed's
AutoTP llama split makes column- or row-parallel under our stage's names, the grid's rank layout the data loader
relies on, the one-line refusals, and the DeepSpeed config's batch size and switches. The split's numbers are
checked end to end on four processes (tests/train/run/test_pipeline_tensor_parallel.py)."""

import pytest
from deepspeed.module_inject.autotp_config import AutoTPPresets, PartitionType

from adaptive.errors import AdaptiveError
from adaptive.models import AdaptiveConfig
from adaptive.models.pipeline_tp import check_shardable, pipeline_topology
from adaptive.train.run.callbacks import Knobs
from adaptive.train.run.runplan import World, ds_config_for_knobs, finalize_ds_config, pipeline_zero


def test_the_llama_split_covers_every_linear_of_a_dense_block_by_our_names():
    preset = AutoTPPresets.llama()
    kinds = {name: preset.find_matching_spec(f"layer.{name}.weight").partition_type
             for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert [n for n, k in kinds.items() if k == PartitionType.ROW] == ["self_attn.o_proj", "mlp.down_proj"]
    assert all(k == PartitionType.COLUMN for n, k in kinds.items() if n not in ("self_attn.o_proj", "mlp.down_proj"))
    assert preset.find_matching_spec("layer.input_layernorm.weight") is None  # norms stay whole


@pytest.mark.parametrize("world, pp, tp", [(4, 2, 2), (8, 2, 2), (16, 4, 2), (8, 2, 4)])
def test_the_grid_keeps_a_stages_tp_ranks_consecutive_and_the_replica_is_rank_over_tp_mod_replicas(world, pp, tp):
    """setup.load_data gives rank r the replica (r // tp) % replicas: DeepSpeed's grid must agree, or a stage's TP
    ranks (or a pipeline's stages) would draw different samples."""
    topo = pipeline_topology(world, pp, tp)
    replicas = world // (pp * tp)
    assert topo.get_axis_comm_lists("model") == [list(range(r, r + tp)) for r in range(0, world, tp)]
    for rank in range(world):
        coord = topo.get_coord(rank)
        assert coord.data == (rank // tp) % replicas
        assert coord.model == rank % tp


def test_a_block_that_does_not_split_is_one_line():
    check_shardable(AdaptiveConfig.from_preset("debug"), 2)  # 4 heads, 2 key-value heads, MLP 192
    for config, tp, match in [
        (AdaptiveConfig.from_preset("debug"), 4, r"key-value heads \(2\) must be divisible by --tp-size \(4\)"),
        (AdaptiveConfig.from_preset("debug", intermediate_size=191), 2, r"MLP width .*\(191\)"),
        (AdaptiveConfig.from_preset("debug", arch="moe"), 2, r"only dense blocks"),
        (AdaptiveConfig.from_preset("debug", arch="mod"), 2, r"only dense blocks"),
    ]:
        with pytest.raises(AdaptiveError, match=match) as err:
            check_shardable(config, tp)
        assert "\n" not in str(err.value)


def test_the_run_plan_takes_tp_with_pp_for_dense_models_only():
    assert pipeline_zero(2, None, 1, 2, None, "dense", World(4, 4)) == 1  # ZeRO-1 over the one replica
    assert pipeline_zero(2, 1, 1, 2, None, "dense", World(8, 8)) == 1
    for arch in ("moe", "mod", "hybrid"):
        with pytest.raises(AdaptiveError, match=f"not {arch}'s experts or routers"):
            pipeline_zero(2, None, 1, 2, None, arch, World(4, 4))


def test_the_deepspeed_config_counts_replicas_and_leaves_autotp_off():
    knobs = Knobs(micro_batch_size=2, gradient_accumulation_steps=4, seq_len=32, gradient_checkpointing=False,
                  zero_stage=1, offload_optimizer=False, offload_params=False, ep_size=1, tp_size=2, pp_size=2)
    # 16 processes as 2 stages x 2 TP ranks x 4 replicas: DeepSpeed asserts micro x accumulation x replicas
    # (runtime/pipe/engine.py:103)
    assert ds_config_for_knobs({}, knobs, 16)["train_batch_size"] == 2 * 4 * 4
    cfg = finalize_ds_config({"tensor_parallel": {"autotp_size": 2}}, knobs, 16, "fp32")
    assert "tensor_parallel" not in cfg  # AutoTP's engine path would replace the pipeline's grid (engine.py:957)
    alone = finalize_ds_config({}, Knobs(**{**knobs.__dict__, "pp_size": 1}), 16, "fp32")
    assert alone["tensor_parallel"]["autotp_size"] == 2 and alone["train_batch_size"] == 2 * 4 * 16
