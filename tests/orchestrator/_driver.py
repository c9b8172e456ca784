"""A recipe with the orchestrator on and test-only fault injectors, run under `accelerate launch`:

    accelerate launch --use_deepspeed --num_processes 1 tests/orchestrator/_driver.py PRESET ARCH SPEC -- FLAGS

SPEC is JSON: {"record": DIR, "oom_at": [5, 7], "nan_at": [11, 13, 14]} (steps are 1-based optimizer steps).
- oom_at: raise torch.OutOfMemoryError after micro-batch 1 of those steps, on their first try only;
- nan_at: a forward hook on the LM head (PyTorch's register_forward_hook; nothing is patched) turns the
  logits, hence the loss, into NaN in those steps, once per step number (a replay after a rollback is clean);
- record: every event with the step, a hash of all parameters, the LR in force and why a step was skipped;
  per micro-batch its shape, its token ids in order and its predicted (target) tokens.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from adaptive.models.checkpointing import checkpointing_policy
from adaptive.train.run.callbacks import Callback
from adaptive.recipe import main
from tests.train._driver import Recorder


def params_hash(state) -> str:
    digest = hashlib.sha1()
    for p in state.model.module.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    for gate_bias in (b for n, b in state.model.module.named_buffers() if n.endswith("e_score_correction_bias")):
        digest.update(gate_bias.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class OrchestratorRecorder(Recorder):
    def on_backward_end(self, state, control, *, outputs, loss, batch):
        super().on_backward_end(state, control, outputs=outputs, loss=loss, batch=batch)
        labels = batch["labels"]
        self.events[-1].update(shape=list(batch["input_ids"].shape), tokens=batch["input_ids"].flatten().tolist(),
                               targets=int((labels[:, 1:] != -100).sum()))

    def on_step_start(self, state, control):
        self._add(state, "on_step_start", samples_seen=state.samples_seen, params=params_hash(state),
                  param_lr=state.optimizer.param_groups[0]["lr"], scheduled_lr=state.scheduler.get_last_lr()[0],
                  knobs=state.knobs.as_dict())

    def on_step_end(self, state, control, *, metrics):
        super().on_step_end(state, control, metrics=metrics)
        self.events[-1].update(params=params_hash(state), last_skip=state.last_skip,
                               tokens_seen=state.tokens_seen, policy_in_model=checkpointing_policy(state.model.module))

    def on_checkpoint(self, state, control, *, path):
        self._add(state, "on_checkpoint", path=str(path), params=params_hash(state))


class InjectOOMAt(Callback):
    def __init__(self, steps: list[int]) -> None:
        self.steps = set(steps)

    def on_backward_end(self, state, control, *, outputs, loss, batch):
        if state.step + 1 in self.steps and state.micro_step == 1 and state.attempt == 0:
            raise torch.OutOfMemoryError("injected by the test")


class PoisonLoss(Callback):
    def __init__(self, steps: list[int]) -> None:
        self.steps = set(steps)
        self.active = False
        self.done: set[int] = set()

    def on_train_start(self, state, control):
        model = state.accelerator.unwrap_model(state.model)
        model.lm_head.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        return output * float("nan") if self.active else None

    def on_step_start(self, state, control):
        step = state.step + 1
        self.active = step in self.steps and step not in self.done
        if self.active:
            self.done.add(step)

    def on_step_end(self, state, control, *, metrics):
        self.active = False


def callbacks_from(spec: dict) -> list[Callback]:
    out: list[Callback] = []
    if "record" in spec:
        out.append(OrchestratorRecorder(spec["record"]))
    if "oom_at" in spec:
        out.append(InjectOOMAt(spec["oom_at"]))
    if "nan_at" in spec:
        out.append(PoisonLoss(spec["nan_at"]))
    return out


if __name__ == "__main__":
    preset, arch, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    flags = sys.argv[5:] if len(sys.argv) > 4 and sys.argv[4] == "--" else sys.argv[4:]
    raise SystemExit(main(preset, arch, flags, callbacks=callbacks_from(spec)))
