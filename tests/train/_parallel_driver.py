"""A debug recipe (dense, or the arch given) with a callback that records what sequence and tensor parallelism
did, per rank:

    accelerate launch --use_deepspeed --num_processes 2 tests/train/_parallel_driver.py OUT_DIR [ARCH] -- FLAGS

OUT_DIR/rank{R}.json: the modules AutoTP put in place and their weight shapes (an MoE layer's first expert's
too), whether DeepSpeed's Ulysses attention replaced transformers' sdpa, the batch shapes the model saw, and
each micro-batch's loss.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from adaptive.recipe import Recipe
from adaptive.train.run.callbacks import Callback


def shape(weight) -> list[int]:
    return list(getattr(weight, "ds_shape", weight.shape))  # under ZeRO-3 the tensor is this rank's partition


class ParallelRecorder(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.record: dict = {"batches": [], "losses": []}

    def on_train_start(self, state, control):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        model = state.accelerator.unwrap_model(state.model)
        layer = model.model.layers[0]
        for moe in (m.mlp for m in model.model.layers if hasattr(m.mlp, "deepspeed_moe")):
            expert = moe.deepspeed_moe.experts.deepspeed_experts[0]
            self.record.update(expert_up_proj=type(expert.up_proj).__name__,
                               expert_up_proj_shape=shape(expert.up_proj.weight),
                               expert_down_proj=type(expert.down_proj).__name__,
                               expert_down_proj_shape=shape(expert.down_proj.weight),
                               local_experts=len(moe.deepspeed_moe.experts.deepspeed_experts))
            break
        if hasattr(layer.mlp, "down_proj"):  # a dense MLP
            self.record.update(down_proj=type(layer.mlp.down_proj).__name__,
                               down_proj_shape=shape(layer.mlp.down_proj.weight))
        self.record.update(
            q_proj=type(layer.self_attn.q_proj).__name__, lm_head=type(model.lm_head).__name__,
            q_proj_shape=shape(layer.self_attn.q_proj.weight),
            sdpa=getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "__qualname__", ""),
            attn_implementation=model.config._attn_implementation,
            dp_world_size=state.model.dp_world_size,
        )
        weight = layer.self_attn.q_proj.weight

        def partitions(*_):  # layer 0 released by now: ZeRO-3's partition, and hpZ's secondary one for backward
            for name in ("ds_tensor", "ds_secondary_tensor"):
                if getattr(weight, name, None) is not None:
                    self.record[f"q_proj_{name}_numel"] = getattr(weight, name).numel()

        model.model.layers[1].register_forward_hook(partitions)

    def on_backward_end(self, state, control, *, outputs, loss, batch):
        self.record["batches"].append({k: list(v.shape) for k, v in batch.items() if hasattr(v, "shape")})
        self.record["losses"].append(float(loss))

    def on_train_end(self, state, control):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"rank{state.accelerator.process_index}.json"
        path.write_text(json.dumps(self.record))


if __name__ == "__main__":
    split = sys.argv.index("--")
    out, arch, rest = sys.argv[1], (sys.argv[2:split] or ["dense"])[0], sys.argv[split + 1:]
    recipe = Recipe(model="debug", arch=arch)
    raise SystemExit(recipe.main(rest, callbacks=[ParallelRecorder(out)]))
