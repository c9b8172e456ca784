"""The debug dense recipe with a callback that records what sequence and tensor parallelism did, per rank:

    accelerate launch --use_deepspeed --num_processes 2 tests/train/_parallel_driver.py OUT_DIR -- FLAGS

OUT_DIR/rank{R}.json: the modules AutoTP put in place and their weight shapes, whether DeepSpeed's Ulysses
attention replaced transformers' sdpa, the batch shapes the model saw, and each micro-batch's loss.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from adaptive.recipe import Recipe
from adaptive.train.callbacks import Callback


class ParallelRecorder(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.record: dict = {"batches": [], "losses": []}

    def on_train_start(self, state, control):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        model = state.accelerator.unwrap_model(state.model)
        layer = model.model.layers[0]
        self.record.update(
            q_proj=type(layer.self_attn.q_proj).__name__, down_proj=type(layer.mlp.down_proj).__name__,
            lm_head=type(model.lm_head).__name__,
            q_proj_shape=list(layer.self_attn.q_proj.weight.shape),
            down_proj_shape=list(layer.mlp.down_proj.weight.shape),
            sdpa=getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "__qualname__", ""),
            attn_implementation=model.config._attn_implementation,
            dp_world_size=state.model.dp_world_size,
        )

    def on_backward_end(self, state, control, *, outputs, loss, batch):
        self.record["batches"].append({k: list(v.shape) for k, v in batch.items() if hasattr(v, "shape")})
        self.record["losses"].append(float(loss))

    def on_train_end(self, state, control):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"rank{state.accelerator.process_index}.json"
        path.write_text(json.dumps(self.record))


if __name__ == "__main__":
    out, rest = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    recipe = Recipe(model="debug", arch="dense")
    raise SystemExit(recipe.main(rest, callbacks=[ParallelRecorder(out)]))
