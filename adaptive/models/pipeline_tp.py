"""Tensor parallelism inside the pipeline's stages (`--pp-size P --tp-size T`), Megatron-style on DeepSpeed's 3D grid.

Why not AutoTP's own path: `tensor_parallel.autotp_size` makes DeepSpeed's engine build a world-wide (data, tensor)
mesh and take it as the engine's mpu (deepspeed/runtime/engine.py:957), which replaces the pipeline's grid, and
AutoTP's replacement pass takes its group from that mesh in training mode (module_inject/auto_tp.py:397). So:

- the pipeline module is built on `PipeModelDataParallelTopology(num_pp=P, num_mp=T, num_dp=world / (P x T))`
  (runtime/pipe/topology.py:245). Its axes are pipe, data, model, the model axis fastest: a stage's T tensor-parallel
  ranks are consecutive, and the grid's slice group (`get_slice_parallel_group`, topology.py:471) is their group;
- each stage's decoder blocks get DeepSpeed's own tensor-parallel layers (module_inject/layers.py) on that group,
  split as AutoTP's llama preset splits them (`AutoTPPresets.llama`, module_inject/autotp_config.py:332): q/k/v and
  gate/up are `LinearLayer`s (column-parallel: this rank's output rows; the input's gradient is all-reduced in
  backward, layers.py:313), o_proj and down_proj are `LinearAllreduce`s (row-parallel: this rank's input columns; the
  output is all-reduced in forward, layers.py:225). A rank holds heads / T query and key-value heads (the attention
  reshapes by head_dim, so its shapes follow) and intermediate / T of the MLP;
- the embedding, the norms and the LM head stay whole on every TP rank of their stage: their gradients are equal
  there, because what reaches them has been all-reduced;
- between stages each TP rank sends its 1/T of the activation and the next stage all-gathers it over its TP group
  (DeepSpeed's `pipe_partitioned` / `grad_partitioned`, on by default when the grid has a model axis,
  runtime/pipe/engine.py:137; it runs on gloo too).

The gradient norm (clipping) counts each weight once. DeepSpeed counts a parameter on a rank when it is marked
model-parallel or the rank is the first of its group (runtime/utils.py:394 clip_grad_norm_, zero/stage_1_and_2.py:1922
ZeRO-1, runtime/utils.py:522 the bf16 path): a shard is (the TP layer sets `tensor_model_parallel`), a whole weight
is marked on TP rank 0 only.

The HF export all-gathers the shards over the slice group (column shards along dim 0, row shards along dim 1) into
the whole weights, so a pp x tp run exports the same folder as a pp 1 tp 1 run.

Dense models only: an MoE block's experts and a MoD router are not split here (refused in one line by the run plan).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.module_inject.autotp_config import AutoTPPresets, PartitionType
from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, TensorParallel_Layer, set_autotp_mode
from deepspeed.module_inject.tp_shard import AutoTPMeta
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from adaptive.errors import AdaptiveError

SPLIT_DIM = {LinearLayer: 0, LinearAllreduce: 1}  # where a shard's rows (column-parallel) or columns (row) sit


def pipeline_topology(world_size: int, pp: int, tp: int) -> PipeModelDataParallelTopology:
    """DeepSpeed's pipe x data x model grid for `world_size` processes."""
    if world_size % (pp * tp):
        raise AdaptiveError(f"--pp-size {pp} x --tp-size {tp} must divide the {world_size} processes")
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world_size // (pp * tp))


def check_shardable(config, tp: int) -> None:
    """One line when a stage's blocks cannot be split T ways here (the run plan refuses these earlier)."""
    if config.moe_layers or config.mod_layers:
        raise AdaptiveError(f"--tp-size {tp} with --pp-size: only dense blocks are split inside the pipeline's stages")
    for name, size in (("attention heads", config.num_attention_heads),
                       ("key-value heads", config.num_key_value_heads),
                       ("MLP width (intermediate_size)", config.intermediate_size)):
        if size % tp:
            raise AdaptiveError(f"{name} ({size}) must be divisible by --tp-size ({tp}) inside the pipeline's stages")


def shard_stage(pipe: nn.Module, blocks: list[nn.Module]) -> int:
    """Replace the decoder-block linears of this stage (`blocks`, its `DecoderLayerPipe`s) with DeepSpeed's TP layers
    on the grid's slice group (the weights, whole, already loaded: each layer keeps its rank's slice); mark the
    stage's parameters for the gradient norm. Returns the number of linears replaced."""
    grid = pipe.mpu()  # the PipelineModule's PipelineParallelGrid
    tp = grid.get_slice_parallel_world_size()
    check_shardable(pipe.config, tp)
    # the TP layers' training behaviour: weights keep requires_grad, the forward all-reduce is autograd's
    # (layers.py:176 is_autotp_training_mode, :220); deepspeed.initialize sets it for AutoTP the same way (__init__.py:552)
    set_autotp_mode(training=True)
    group, preset = grid.get_slice_parallel_group(), AutoTPPresets.llama()
    meta = AutoTPMeta.from_model_config(pipe.config)
    replaced = 0
    for block in blocks:
        for name, child in list(block.named_modules()):
            if not isinstance(child, nn.Linear):
                continue
            spec = preset.find_matching_spec(f"{name}.weight")
            if spec is None:  # a linear the preset does not split would be whole on each rank but see a shard
                raise AdaptiveError(f"{name}: a linear layer the tensor-parallel split does not cover")
            layer = LinearLayer if spec.partition_type == PartitionType.COLUMN else LinearAllreduce
            parent_name, _, attr = name.rpartition(".")
            setattr(block.get_submodule(parent_name), attr, layer(child, group, name=name, tp_meta=meta))
            replaced += 1
    mark_for_gradient_norm(pipe, grid.get_slice_parallel_rank())
    return replaced


def mark_for_gradient_norm(pipe: nn.Module, tp_rank: int) -> None:
    """`model_parallel` on each parameter this rank adds to the gradient norm: its own shards, and on TP rank 0 the
    stage's whole weights (a tied copy after the first stage's: never, as before)."""
    for p in pipe.parameters():
        shard = getattr(p, "tensor_model_parallel", False)
        p.model_parallel = not getattr(p, "ds_pipe_replicated", False) and (shard or tp_rank == 0)


def gather_shards(pipe: nn.Module) -> dict[str, torch.Tensor]:
    """This stage's TP-split weights, all-gathered whole, under the pipeline module's keys, on TP rank 0 ({}
    elsewhere). A collective over the slice group: every rank of the stage calls it."""
    grid = pipe.mpu()  # the PipelineModule's PipelineParallelGrid
    group, tp = grid.get_slice_parallel_group(), grid.get_slice_parallel_world_size()
    whole: dict[str, torch.Tensor] = {}
    for prefix, module in pipe.named_modules():
        if not isinstance(module, TensorParallel_Layer):
            continue
        dim = SPLIT_DIM[type(module)]
        for name, param in module.named_parameters(recurse=False):
            if dim == 1 and name == "bias":  # a row-parallel bias is whole on every rank
                continue
            parts = [torch.empty_like(param) for _ in range(tp)]
            dist.all_gather(parts, param.detach().contiguous(), group=group)
            whole[f"{prefix}.{name}"] = torch.cat(parts, dim=dim).cpu()
    return whole if grid.get_slice_parallel_rank() == 0 else {}


__all__ = ["SPLIT_DIM", "check_shardable", "gather_shards", "mark_for_gradient_norm", "pipeline_topology",
           "shard_stage"]
