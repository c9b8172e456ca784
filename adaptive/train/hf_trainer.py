"""The orchestrator on a transformers `Trainer`: one `TrainerCallback` that forwards the Trainer's
events to the same policies the recipes' loop runs.

    from adaptive.orchestrator import policies
    from adaptive.train.hf_trainer import OrchestratorCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[OrchestratorCallback(policies())])

Nothing is subclassed or patched. The Trainer's callbacks never see model outputs, so the adapter
registers a forward hook on the model (PyTorch's `register_forward_hook`) that keeps each training
forward's `router_stats` and loss; they are handed to `on_backward_end` at the Trainer's
`on_substep_end` / `on_pre_optimizer_step`, i.e. after that micro-batch's backward.

Event map: on_train_begin -> on_train_start; on_step_begin -> on_step_start; the micro-batches ->
on_backward_end; on_optimizer_step -> on_optimizer_step; on_step_end -> on_step_end (with a stub
`{"step": n}` as metrics on logging steps, since the Trainer logs after on_step_end, which is
when the monitor summarises); on_evaluate -> on_eval; on_save -> on_checkpoint; on_train_end ->
on_train_end.

Requests the Trainer can honour: should_stop, should_checkpoint, should_evaluate (its control
flags) and lr_scale (the adapter scales the optimizer's LR after each scheduler step). The Trainer
has no hook to skip a step's update, redo a step after an OOM, change the batch knobs, or roll back:
such requests are dropped with a warning (use the recipes' loop for those policies).
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from transformers import TrainerCallback

from adaptive.train.run.callbacks import CallbackList, Control, Knobs, TrainerState

logger = logging.getLogger(__name__)

UNSUPPORTED = ("skip_step", "retry_step", "rollback_to_checkpoint")


class OrchestratorCallback(TrainerCallback):
    """Runs `callbacks` (e.g. `adaptive.orchestrator.policies()`) inside a transformers Trainer."""

    def __init__(self, callbacks: list[Any], plan: Any = None, seq_len: int = 0) -> None:
        self.chain = CallbackList(list(callbacks))
        self.plan = plan
        self.seq_len = seq_len
        self.state: TrainerState | None = None
        self.control = Control()
        self._captured: list[Any] = []
        self._hook: Any = None
        self._warned: set[str] = set()

    # --- the hook ---------------------------------------------------------------------------

    def _capture(self, module: Any, inputs: Any, output: Any) -> None:
        import torch

        if not module.training or not torch.is_grad_enabled():
            return
        loss = getattr(output, "loss", None)
        self._captured.append(SimpleNamespace(router_stats=getattr(output, "router_stats", None),
                                              loss=loss.detach() if loss is not None else None))

    def _flush(self) -> None:
        import torch

        captured, self._captured = self._captured, []
        for out in captured:
            loss = out.loss if out.loss is not None else torch.zeros(())
            self.chain.on_backward_end(self.state, self.control, outputs=out, loss=loss, batch={})
            self.state.micro_step += 1

    # --- Trainer events -------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        config = getattr(model, "config", None)
        knobs = Knobs(micro_batch_size=args.per_device_train_batch_size,
                      gradient_accumulation_steps=args.gradient_accumulation_steps, seq_len=self.seq_len,
                      gradient_checkpointing=bool(args.gradient_checkpointing), zero_stage=0,
                      offload_optimizer=False, offload_params=False, ep_size=getattr(config, "ep_size", 1) or 1)
        self.state = TrainerState(max_steps=state.max_steps, knobs=knobs, output_dir=Path(args.output_dir),
                                  plan=self.plan, orchestrator=True, model=model, optimizer=optimizer,
                                  scheduler=lr_scheduler, step=state.global_step, world_size=args.world_size)
        if state.global_step:  # resume_from_checkpoint: the event log keeps the decisions up to here
            self.state.resumed_from = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self._hook = model.register_forward_hook(self._capture)
        self.chain.on_train_start(self.state, self.control)
        self._apply(control)

    def on_step_begin(self, args, state, control, **kwargs):
        self._captured = []
        self.state.micro_step = 0
        self.chain.on_step_start(self.state, self.control)
        self._apply(control)

    def on_substep_end(self, args, state, control, **kwargs):
        self._flush()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._flush()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.chain.on_optimizer_step(self.state, self.control)

    def on_step_end(self, args, state, control, **kwargs):
        self.state.step = state.global_step
        self.state.micro_step = 0
        logging_step = args.logging_steps and state.global_step % int(args.logging_steps) == 0
        metrics = {"step": state.global_step} if logging_step else None
        self.chain.on_step_end(self.state, self.control, metrics=metrics)
        if self.control.lr_scale is not None:
            self.state.lr_scale, self.control.lr_scale = self.control.lr_scale, None
        if self.state.lr_scale != 1.0 and self.state.optimizer is not None and self.state.scheduler is not None:
            for group, lr in zip(self.state.optimizer.param_groups, self.state.scheduler.get_last_lr()):
                group["lr"] = lr * self.state.lr_scale
        self._apply(control)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.chain.on_eval(self.state, self.control, metrics=dict(metrics or {}))
        self._apply(control)

    def on_save(self, args, state, control, **kwargs):
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self.state.last_checkpoint, self.state.last_checkpoint_step = path, state.global_step
        self.chain.on_checkpoint(self.state, self.control, path=path)
        self._apply(control)

    def on_train_end(self, args, state, control, **kwargs):
        self.state.step = state.global_step
        self.chain.on_train_end(self.state, self.control)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # --- requests -------------------------------------------------------------------------------

    def _apply(self, hf_control: Any) -> None:
        c = self.control
        if c.should_stop:
            hf_control.should_training_stop = True
        if c.should_checkpoint:
            hf_control.should_save = True
        if c.should_evaluate:
            hf_control.should_evaluate = True
        c.should_stop = c.should_checkpoint = c.should_evaluate = c.should_export = False
        for name in UNSUPPORTED:
            if getattr(c, name):
                setattr(c, name, False)
                self._warn(name)
        if c.change_knobs:
            c.change_knobs = {}
            self._warn("change_knobs")

    def _warn(self, what: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("the transformers Trainer cannot honour %s; the request is ignored (the recipes' "
                           "training loop supports it)", what)


__all__ = ["OrchestratorCallback"]
