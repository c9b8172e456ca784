"""Our decoder as a `deepspeed.pipe.PipelineModule` (DeepSpeed's pipeline engine, `--pp-size`).

The layers, in order: `EmbeddingPipe`, one `DecoderLayerPipe` per block, `NormPipe`, `LMHeadPipe` (or, with tied
embeddings, the embedding again through `TiedLayerSpec`). Each wraps the same module class the HF model holds
(`AdaptiveDecoderLayer`, `AdaptiveRMSNorm`, ...), so a stage runs exactly the non-pipelined block code.

What crosses a stage boundary: the hidden states, and for a routed model (MoE, MoD) a float tensor [3] holding
the running sums of the routers' unweighted losses (load balancing, z-loss, MoD BCE). The loss function adds
them to the LM loss with the config's coefficients, as `AdaptiveForCausalLM` does (`_collect_router_stats`:
coefficient x mean over the routed layers), so the pipelined loss is the same quantity. A tensor that crosses
must receive a gradient (DeepSpeed's `_exec_send_grads` asserts it, deepspeed/runtime/pipe/engine.py:1108), so the
embedding starts the sums on its output's graph.

The LM head's weight is used by the loss function on the last stage (it alone gets the labels): the lean chunked
loss in training, logits and transformers' loss otherwise, the same two paths as the HF model.

Weights map both ways by name (`pipeline_key`, `hf_key`): `model.layers.{i}.X` is layer `i + 1`'s `layer.X`, and
so on. The run builds the HF model first (same seed, same weights as a pp 1 run, `--init-from` loaded), then the
stages copy their layers' weights from it (`load_hf_state`); an export gathers the stages' weights back into the
HF state dict (`gather_hf_state_dict`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask

from adaptive.errors import AdaptiveError
from adaptive.models.configuration_adaptive import AdaptiveConfig
from adaptive.models.lean import ChunkedLMLossFunction, loss_chunk_tokens, shift_labels
from adaptive.models.modeling_adaptive import (AdaptiveDecoderLayer, AdaptiveRMSNorm, AdaptiveRotaryEmbedding,
                                               AdaptiveRouterStats, router_aux_loss)
from adaptive.plan.estimate.activations import parse_checkpoint_policy

PARTITIONS = ("parameters", "uniform")  # or type:REGEX (DeepSpeed's partition_method)
TIED_KEY = "embed"
IGNORE_INDEX = -100


def check_partition(method: str) -> str:
    """DeepSpeed's partition_method values that work here; one line naming the bad one."""
    if method in PARTITIONS:
        return method
    if method.startswith("type:") and method[5:]:
        try:
            re.compile(method[5:], re.IGNORECASE)
        except re.error as err:
            raise AdaptiveError(f"--pp-partition {method}: not a regular expression ({err})") from None
        return method
    raise AdaptiveError(f"--pp-partition must be parameters, uniform or type:REGEX, got {method!r}")


def routed(config: AdaptiveConfig) -> bool:
    """A model whose routers add a loss: its stages carry the running router-loss sums."""
    return bool(config.moe_layers or config.mod_layers)


class EmbeddingPipe(nn.Module):
    def __init__(self, config: AdaptiveConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    def forward(self, input_ids: torch.Tensor):
        hidden = self.embed_tokens(input_ids)
        if not routed(self.config):
            return hidden
        # the sums start at zero, on the graph: the stage's backward needs a grad_fn (x 0 changes nothing)
        sums = hidden.new_zeros(3) + 0.0 * hidden[0, 0, 0]
        return hidden, sums


class DecoderLayerPipe(nn.Module):
    """One `AdaptiveDecoderLayer`, with the positions and causal mask the HF model's forward builds (no padding:
    the training data are packed blocks). `checkpoint`: recompute the block in backward (the run's policy)."""

    def __init__(self, config: AdaptiveConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer = AdaptiveDecoderLayer(config, layer_idx)
        self.rotary_emb = AdaptiveRotaryEmbedding(config)  # buffers only, none saved
        self.checkpoint = False
        self.recorded: list[Any] = []  # the router statistics of each training forward since the last take
        self._stats: Any = None

    def forward(self, inputs):
        hidden, sums = (inputs, None) if torch.is_tensor(inputs) else inputs
        if self.checkpoint and self.training and torch.is_grad_enabled():
            out, extra = torch.utils.checkpoint.checkpoint(self._block, hidden, use_reentrant=False)
        else:
            out, extra = self._block(hidden)
        if self.training and sums is not None:  # once per micro-batch (a recompute in backward runs _block only)
            self.recorded.append(self._stats)
        if sums is None:
            return out
        return out, sums + extra

    def _block(self, hidden: torch.Tensor):
        seq = hidden.shape[1]
        position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=None)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        out, stats = self.layer(hidden, attention_mask=mask, position_ids=position_ids, cache=None, use_cache=False,
                                position_embeddings=position_embeddings, padding_mask=None)
        zero = hidden.new_zeros(())
        moe, mod = stats.moe, stats.mod
        self._stats = stats
        extra = torch.stack([moe.l_aux.to(hidden.dtype) if moe is not None else zero,
                             moe.z_loss.to(hidden.dtype) if moe is not None else zero,
                             mod.bce_loss.to(hidden.dtype) if mod is not None else zero])
        return out, extra


class NormPipe(nn.Module):
    def __init__(self, config: AdaptiveConfig):
        super().__init__()
        self.norm = AdaptiveRMSNorm(config.hidden_size, eps=config.rms_norm_eps, lean=config.kernels == "lean")

    def forward(self, inputs):
        if torch.is_tensor(inputs):
            return self.norm(inputs)
        hidden, sums = inputs
        return self.norm(hidden), sums


class LMHeadPipe(nn.Module):
    """Holds the head's weight; the loss function (last stage, with the labels) applies it."""

    def __init__(self, config: AdaptiveConfig):
        super().__init__()
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, inputs):
        return inputs


def _tied_head(module: EmbeddingPipe, inputs):
    return inputs


class AdaptivePipelineModule(PipelineModule):
    """The pipelined model; `config` is the HF model's (accelerate and the run read it)."""

    def __init__(self, config: AdaptiveConfig, num_stages: int, partition_method: str = "parameters",
                 topology: Any = None):
        layers: list[Any] = []
        tied = config.tie_word_embeddings
        layers.append(TiedLayerSpec(TIED_KEY, EmbeddingPipe, config, tied_weight_attr=["embed_tokens.weight"])
                      if tied else LayerSpec(EmbeddingPipe, config))
        layers += [LayerSpec(DecoderLayerPipe, config, i) for i in range(config.num_hidden_layers)]
        layers.append(LayerSpec(NormPipe, config))
        layers.append(TiedLayerSpec(TIED_KEY, EmbeddingPipe, config, forward_fn=_tied_head,
                                    tied_weight_attr=["embed_tokens.weight"]) if tied else LayerSpec(LMHeadPipe, config))
        # topology: DeepSpeed's pipe x data x model grid under --tp-size (pipeline_tp.py); else pipe x data
        super().__init__(layers, num_stages=None if topology else num_stages, topology=topology, loss_fn=self._loss,
                         partition_method=check_partition(partition_method), activation_checkpoint_interval=0)
        self.config = config
        self._last_parts: tuple[torch.Tensor, torch.Tensor] | None = None
        self.micro_losses: list[torch.Tensor] = []  # the last stage's training micro-batch losses since the last take
        # DeepSpeed's fp32 gradient clipping and ZeRO-1's norm count a parameter once over the pipeline's ranks
        # only when it is marked model-parallel (runtime/utils.py clip_grad_norm_, model_parallel_rank == 0 or
        # is_model_parallel_parameter); every stage's own parameters are, a tied copy after the first is not
        for p in self.parameters():
            p.model_parallel = not getattr(p, "ds_pipe_replicated", False)

    # -- the loss (last stage)

    def _head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.tied_modules[TIED_KEY].embed_tokens.weight
        return self.forward_funcs[-1].lm_head.weight

    def _loss(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        hidden, sums = (outputs, None) if torch.is_tensor(outputs) else outputs
        lm = lm_loss(self._head_weight(), hidden, labels, lean=self.config.kernels == "lean" and self.training)
        if sums is None or not self.training:  # evaluation reports the LM loss alone, as the loop's eval does
            self._last_parts = (lm.detach(), lm.new_zeros(()))
            if self.training:
                self.micro_losses.append(lm.detach())
            return lm
        aux = router_loss(self.config, sums)
        self._last_parts = (lm.detach(), aux.detach())
        self.micro_losses.append((lm + aux).detach())
        return lm + aux

    def get_additional_losses(self):
        """The LM and router parts of the last micro-batch's loss; DeepSpeed sums them over the step, averages
        over data-parallel replicas and broadcasts them along the pipeline (pipe/engine.py _aggregate_total_loss).
        Every stage names the same ones (the others only count them)."""
        if not routed(self.config):
            return None
        lm, aux = self._last_parts if self._last_parts is not None else (torch.zeros(()), torch.zeros(()))
        return {"lm_loss": lm, "aux_loss": aux}

    def local_moe_rows(self) -> list[int]:
        """This stage's MoE layers as rows of the model's [moe_layers, E] statistics, in module order (the
        orchestrator's balance policy updates this stage's gates from those rows)."""
        rows = list(self.config.moe_layers)
        return [rows.index(m.layer.layer_idx) for m in self.forward_funcs
                if isinstance(m, DecoderLayerPipe) and m.layer.layer_idx in rows]

    # -- checkpointing policy (the same recompute as the HF model's, adaptive/models/checkpointing.py)

    def set_checkpoint_policy(self, policy: str) -> None:
        kind, n = parse_checkpoint_policy(policy)
        for module in self.forward_funcs:
            if isinstance(module, DecoderLayerPipe):
                index = module.layer.layer_idx
                module.layer.checkpoint_mlp = kind == "mlp"
                module.checkpoint = kind == "full" or (kind == "every" and index % n == 0)


def lm_loss(weight: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, lean: bool) -> torch.Tensor:
    """`AdaptiveForCausalLM`'s LM loss: the chunked head (`lean_causal_lm_loss`) in lean training, else logits
    and transformers' ForCausalLMLoss."""
    labels = labels.to(hidden.device)
    if lean:
        targets = shift_labels(labels).reshape(-1)
        total = ChunkedLMLossFunction.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets,
                                            loss_chunk_tokens(weight.shape[0]))
        return total / (targets != IGNORE_INDEX).sum()
    return ForCausalLMLoss(F.linear(hidden, weight), labels, vocab_size=weight.shape[0])


def router_loss(config: AdaptiveConfig, sums: torch.Tensor) -> torch.Tensor:
    """The HF model's router term (`router_aux_loss`) from the sums the stages carried: their means over the
    routed layers."""
    moe, mod = len(config.moe_layers), len(config.mod_layers)
    return router_aux_loss(config, sums[0] / moe if moe else None, sums[1] / moe if moe else None,
                           sums[2] / mod if mod else None)


# ---------------------------------------------------------------------------------------------
# Weights: the HF model's names <-> the pipeline module's


def pipeline_key(hf: str, config: AdaptiveConfig) -> str | None:
    """The pipeline module's name for an HF state-dict key; None for the tied head (it is the embedding)."""
    last = config.num_hidden_layers + 1
    embed = f"tied_modules.{TIED_KEY}.embed_tokens." if config.tie_word_embeddings else "0.embed_tokens."
    if hf.startswith("model.embed_tokens."):
        return embed + hf.removeprefix("model.embed_tokens.")
    if m := re.match(r"model\.layers\.(\d+)\.(.*)$", hf):
        return f"{int(m.group(1)) + 1}.layer.{m.group(2)}"
    if hf.startswith("model.norm."):
        return f"{last}.norm.{hf.removeprefix('model.norm.')}"
    if hf.startswith("lm_head."):
        return None if config.tie_word_embeddings else f"{last + 1}.lm_head.{hf.removeprefix('lm_head.')}"
    raise AdaptiveError(f"{hf}: not a weight of the adaptive decoder")


def hf_key(key: str, config: AdaptiveConfig) -> str:
    """The HF state-dict key of a pipeline module's key."""
    last = config.num_hidden_layers + 1
    if m := re.match(rf"(?:tied_modules\.{TIED_KEY}|0)\.embed_tokens\.(.*)$", key):
        return f"model.embed_tokens.{m.group(1)}"
    if m := re.match(r"(\d+)\.layer\.(.*)$", key):
        return f"model.layers.{int(m.group(1)) - 1}.{m.group(2)}"
    if m := re.match(rf"{last}\.norm\.(.*)$", key):
        return f"model.norm.{m.group(1)}"
    if m := re.match(rf"{last + 1}\.lm_head\.(.*)$", key):
        return f"lm_head.{m.group(1)}"
    raise AdaptiveError(f"{key}: not a weight of the pipelined adaptive decoder")


def load_hf_state(pipe: AdaptivePipelineModule, state: dict[str, torch.Tensor]) -> None:
    """Copy this stage's weights from the HF model's state dict (every stage key must be found)."""
    own = pipe.state_dict(keep_vars=True)
    with torch.no_grad():
        for key, param in own.items():
            name = hf_key(key, pipe.config)
            if name not in state:
                raise AdaptiveError(f"the HF state dict has no {name} for the pipeline's {key}")
            param.copy_(state[name])


def local_hf_state(pipe: AdaptivePipelineModule) -> dict[str, torch.Tensor]:
    """This stage's weights under their HF names (a tied head adds lm_head.weight, as the HF model's dict has)."""
    out = {hf_key(k, pipe.config): v.detach().cpu() for k, v in pipe.state_dict().items()}
    if pipe.config.tie_word_embeddings and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def gather_hf_state_dict(pipe: AdaptivePipelineModule) -> dict[str, torch.Tensor] | None:
    """The whole HF state dict on global rank 0 (None elsewhere): the first data-parallel replica's stages send
    theirs. A collective: every rank calls it."""
    import torch.distributed as dist

    from adaptive.models.moe_deepspeed import globalize_expert_state_dict

    grid = pipe._grid
    # under expert parallelism a stage's replicas hold its experts between them: gather them first (a collective
    # over each stage's expert-parallel group, global expert ids)
    mine = globalize_expert_state_dict(pipe, local_hf_state(pipe))
    mine = mine if grid.data_parallel_id == 0 and grid.get_slice_parallel_rank() == 0 else {}
    if grid.data_parallel_id == 0 and grid.get_slice_parallel_world_size() > 1:  # TP inside the stages
        from adaptive.models.pipeline_tp import gather_shards

        mine.update({hf_key(k, pipe.config): v for k, v in gather_shards(pipe).items()})  # whole, on TP rank 0
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        full.update(part)
    return full


# ---------------------------------------------------------------------------------------------
# What a step leaves on the stages: the router statistics and losses the loop's callbacks and metrics read


def take_router_stats(pipe: AdaptivePipelineModule, micro_batches: int) -> list[AdaptiveRouterStats | None]:
    """Per training micro-batch since the last take, the router statistics in the HF model's shape ([L_moe, E]
    counts, [L_moe] and [L_mod] rates, `_collect_router_stats`), from this stage's layers; the rows of the other
    stages' layers are zero, so a sum over every rank (the metrics' and monitor's all-reduce) holds each layer's
    statistics once per data-parallel replica, as a pp 1 run's does. The per-layer rates (dropped fraction,
    router entropy, MoD skip rate and agreement) are means over the micro-batches of every rank: a layer lives on
    1/pp of the ranks, so its rates are counted pp times here to keep those means. Clears the records."""
    config = pipe.config
    if not routed(config):
        return [None] * micro_batches
    pp = pipe.num_stages
    moe_rows, mod_rows = list(config.moe_layers), list(config.mod_layers)
    experts = config.num_local_experts  # every expert, as the gate counts them (ep_size splits the weights only)
    layers = [m for m in pipe.forward_funcs if isinstance(m, DecoderLayerPipe)]
    device = next(iter(pipe.parameters())).device
    out = []
    for i in range(micro_batches):
        stats = AdaptiveRouterStats(moe_layers=tuple(moe_rows), mod_layers=tuple(mod_rows))
        if moe_rows:
            stats.expert_counts = torch.zeros(len(moe_rows), experts, dtype=torch.int64, device=device)
            stats.dropped_fraction = torch.zeros(len(moe_rows), device=device)
            stats.router_entropy = torch.zeros(len(moe_rows), device=device)
        if mod_rows:
            stats.mod_skip_rate = torch.zeros(len(mod_rows), device=device)
            stats.mod_router_agreement = torch.zeros(len(mod_rows), device=device)
        for layer in layers:
            moe, mod = layer.recorded[i].moe, layer.recorded[i].mod
            index = layer.layer.layer_idx
            if moe is not None:
                row = moe_rows.index(index)
                stats.expert_counts[row] = moe.expert_counts.detach()
                stats.dropped_fraction[row] = moe.dropped_fraction.detach() * pp
                stats.router_entropy[row] = moe.gate_entropy.detach() * pp
            if mod is not None:
                row = mod_rows.index(index)
                stats.mod_skip_rate[row] = mod.skip_rate.detach() * pp
                stats.mod_router_agreement[row] = mod.router_agreement.detach() * pp
        out.append(stats)
    for layer in layers:
        layer.recorded.clear()
    return out


def take_micro_losses(pipe: AdaptivePipelineModule, micro_batches: int) -> torch.Tensor:
    """The training micro-batch losses since the last take (LM + router, as `loss_fn` returned them), broadcast
    from the last stage along the pipeline: every stage gets its replica's. A collective over the pipe group."""
    import torch.distributed as dist

    grid = pipe._grid
    device = next(iter(pipe.parameters())).device
    last = grid.stage_to_global(pipe.num_stages - 1)
    if dist.get_rank() == last:
        losses = torch.stack(pipe.micro_losses[-micro_batches:]).float().to(device)
    else:
        losses = torch.zeros(micro_batches, device=device)
    pipe.micro_losses.clear()
    dist.broadcast(losses, src=last, group=grid.get_pipe_parallel_group())
    return losses


def to_pipeline(model: nn.Module, num_stages: int, partition_method: str, checkpoint_policy: str,
                tp_size: int = 1) -> AdaptivePipelineModule:
    """`model` (an AdaptiveForCausalLM, weights loaded) as a pipeline module of `num_stages` stages, this rank's
    stage built and filled with its weights, its blocks split over `tp_size` ranks (pipeline_tp.py). The random
    state is kept: the stages' fresh layers draw from it before their weights are overwritten, and the run's later
    draws must match a pp 1 run's."""
    topology = None
    if tp_size > 1:
        import torch.distributed as dist

        from adaptive.models.pipeline_tp import check_shardable, pipeline_topology

        check_shardable(model.config, tp_size)
        topology = pipeline_topology(dist.get_world_size(), num_stages, tp_size)
    rng = torch.get_rng_state()
    try:
        pipe = AdaptivePipelineModule(model.config, num_stages, partition_method, topology)
    finally:
        torch.set_rng_state(rng)
    load_hf_state(pipe, model.state_dict())
    if tp_size > 1:
        from adaptive.models.pipeline_tp import shard_stage

        shard_stage(pipe, [m for m in pipe.forward_funcs if isinstance(m, DecoderLayerPipe)])
    pipe.set_checkpoint_policy(checkpoint_policy)
    return pipe


__all__ = ["AdaptivePipelineModule", "DecoderLayerPipe", "EmbeddingPipe", "LMHeadPipe", "NormPipe", "PARTITIONS",
           "check_partition", "gather_hf_state_dict", "hf_key", "lm_loss", "load_hf_state", "local_hf_state",
           "pipeline_key", "router_loss", "routed", "take_micro_losses", "take_router_stats", "to_pipeline"]
