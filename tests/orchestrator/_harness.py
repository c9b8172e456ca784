"""A tiny MoE with a skewed router and a minimal loop that fires the callback events in the training
loop's order (on_train_start, then per step: on_step_start, on_backward_end per micro-batch,
on_optimizer_step, on_step_end; on_train_end). Used in-process and by the two-rank worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
from adaptive.train.run.callbacks import CallbackList, Control, Knobs, TrainerState

VOCAB = 128
TINY_MOE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, block_types=["moe", "moe"],
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=32,
                num_local_experts=8, num_experts_per_tok=2, capacity_factor=1.0, min_capacity=2,
                max_position_embeddings=128)
SKEW = 2.0  # gate weight towards experts 0 and 1 on the shared hidden direction
SHARED = 0.1  # every token's embedding carries this in hidden dimension 0


def skewed_moe(seed: int = 0, **overrides: Any) -> AdaptiveForCausalLM:
    """Every token's embedding has SHARED in dimension 0, and the gates weigh that dimension by SKEW
    for experts 0 and 1 (plus N(0, 0.3) everywhere): at the start, most routes go to experts 0 and 1."""
    torch.manual_seed(seed)
    model = AdaptiveForCausalLM(AdaptiveConfig.from_preset("debug", arch="moe", **{**TINY_MOE, **overrides}))
    skew(model, seed)
    return model


def skew(model: AdaptiveForCausalLM, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = SHARED
        for gate in model.moe_gates():
            router = gate.wg.weight if hasattr(gate, "wg") else gate.weight  # DeepSpeed's TopKGate | ours
            weight = torch.randn(router.shape, generator=generator) * 0.3
            weight[0, 0] += SKEW
            weight[1, 0] += SKEW
            router.copy_(weight)


def fixed_data(seed: int, batches: int = 8, batch: int = 8, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batches, batch, seq), generator=torch.Generator().manual_seed(seed))


def knobs(micro: int = 8, accum: int = 1, seq: int = 32, ep_size: int = 1) -> Knobs:
    return Knobs(micro_batch_size=micro, gradient_accumulation_steps=accum, seq_len=seq, gradient_checkpointing=False,
                 zero_stage=0, offload_optimizer=False, offload_params=False, ep_size=ep_size)


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    state: TrainerState | None = None
    callbacks: list[Any] = field(default_factory=list)


def run_steps(model: Any, callbacks: list[Any], data: torch.Tensor, steps: int, *, engine: Any = None,
              lr: float = 3e-3, plan: Any = None, output_dir: Path | None = None, knob_set: Knobs | None = None,
              world_size: int = 1) -> Run:
    """`steps` optimizer steps on data[step % len(data)]; with a DeepSpeed `engine` it runs forward,
    backward and step through it, else through AdamW."""
    chain = CallbackList(callbacks)
    optimizer = None if engine is not None else torch.optim.AdamW(model.parameters(), lr=lr)
    state = TrainerState(max_steps=steps, knobs=knob_set or knobs(), output_dir=output_dir, plan=plan,
                         orchestrator=True, model=engine if engine is not None else model, optimizer=optimizer,
                         world_size=world_size)
    control = Control()
    run = Run(state=state, callbacks=list(callbacks))
    model.train()
    chain.on_train_start(state, control)
    for step in range(steps):
        chain.on_step_start(state, control)
        ids = data[step % len(data)]
        if engine is not None:
            out = engine(ids, labels=ids)
            engine.backward(out.loss)
        else:
            out = model(ids, labels=ids)
            out.loss.backward()
        chain.on_backward_end(state, control, outputs=out, loss=out.loss.detach(), batch={"input_ids": ids})
        run.losses.append(out.loss.item())
        if engine is not None:
            engine.step()
        else:
            optimizer.step()
            optimizer.zero_grad()
        chain.on_optimizer_step(state, control)
        state.step += 1
        chain.on_step_end(state, control, metrics={"step": state.step})  # every step is a log step
    chain.on_train_end(state, control)
    return run
