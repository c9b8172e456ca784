"""The training loop shared by every recipe: `train(state, loop)`.

One optimizer step = `gradient_accumulation_steps` micro-batches of `micro_batch_size` sequences.
The step's samples (blocks of the run's block length) are drawn from the data iterator once
(`samples_per_step` of them), each block is cut into `pieces_per_block` consecutive sequences of
`seq_len` tokens (one piece, the block itself, unless the OOM ladder shortened the sequence), and
the sequences are sliced into micro-batches. So a retried step (after an OOM, with other knobs,
seq_len included) runs on the same samples and the same tokens; the data position is committed
only when the step completes. Evaluation always runs on whole blocks (the block length), so eval
losses stay comparable across a change of seq_len. Under Ulysses sequence parallelism a rank runs its SP
group's micro-batches in turn, each cut to its shard of the sequence (`sequence_parallel.py`); under
AutoTP a TP group trains on one copy of the data.

The loop drives the DeepSpeed engine directly (what accelerate's `backward` wraps): it marks the
accumulation boundary itself and scales the loss by the accumulation in force
(`scale_wrt_gas=False`), so the micro-batch and accumulation may change while training runs.
Discarding a step's gradients uses DeepSpeed's own overflow path: a non-finite gradient makes
DeepSpeed skip the update and clear its buffers on every rank (ZeRO 1-3, bf16 and fp16
optimizers); the plain fp32 ZeRO-0 optimizer has no such path, so there the loop clears the
gradients (`engine.zero_grad`) and does not step.

Under several processes, skip, stop, checkpoint, export and rollback requests are combined over
the ranks (one small all-reduce per step). An OOM retry is coordinated only when every rank raises
at the same micro-batch (or with one process): a rank that OOMs alone leaves the others waiting in
a collective, which a multi-rank OOM policy has to agree on first.
"""

from __future__ import annotations

import gc
import json
import math
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from accelerate.logging import get_logger

from adaptive import engine as engine_internals
from adaptive.errors import AdaptiveError
from adaptive.models.checkpointing import apply_checkpointing
from adaptive.models.export import has_remote_code  # MoD, hybrid: loaded with trust_remote_code
from adaptive.train.run.callbacks import CallbackList, Control, Knobs, TrainerState
from adaptive.train.run_folder import checkpoint as ckpt
from adaptive.train.data.batches import SampleIterator, eval_batches
from adaptive.train.reporting.display import ProgressDisplay, show_block
from adaptive.train.reporting.metrics import (IntervalMeter, MetricsWriter, StepStats, cuda_memory, mfu, peak_rss_bytes,
                                              read_metrics, train_record)
from adaptive.train.reporting.summary import LaunchTotals, peak_bytes, summary_lines
from adaptive.train.run.runplan import RunPlan, ds_config_for_knobs, replan_for_knobs, with_knobs
from adaptive.train.run.watchdog import Progress

logger = get_logger(__name__)

OOM_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)
EXPORT_REQUEST = "EXPORT"  # touch <output-dir>/EXPORT to export the model after the current step
STOP_REQUEST = "STOP"  # touch <output-dir>/STOP to checkpoint and stop after the current step
FINAL_EXPORT = "hf"  # also known to adaptive.train.run_folder.export (which imports no accelerate)


@dataclass(frozen=True)
class LoopSettings:
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end
    checkpoint_every: int = 1000  # 0: only at the end
    keep_checkpoints: int = 3
    export_every: int = 0  # 0: only at the end (and on request)
    progress: bool = True
    trust_checkpoints: bool = False  # --trust-checkpoint: resume with the full unpickler


@dataclass
class Loop:
    """What the loop uses besides the state callbacks see."""

    run: RunPlan
    data: Any  # setup.Data: tokenizer, train, eval
    callbacks: CallbackList
    metrics: MetricsWriter
    settings: LoopSettings
    device: torch.device
    lr_scheduler: Any  # the transformers LambdaLR (accelerate wraps it in state.scheduler)
    last_eval_step: int = -1
    stop_signal: threading.Event = field(default_factory=threading.Event)
    samples: SampleIterator | None = None  # what train() draws from; its committed state goes into checkpoints
    sequence_shards: Any = None  # sequence_parallel.SequenceShards under Ulysses (sp_size > 1), else None
    data_state: dict[str, Any] | None = None  # this rank's data state read by restore(), for the next SampleIterator
    progress: Progress = field(default_factory=Progress)  # step and phase, for the watchdog (watchdog.py)
    totals: LaunchTotals = field(default_factory=LaunchTotals)  # this launch's steps, for the end-of-run summary
    last_train: dict[str, Any] | None = None  # the last train record written
    last_eval: dict[str, Any] | None = None  # the last eval record written
    peak_memory_bytes: int | None = None  # the highest peak of the train records' memory


@dataclass
class Requests:
    """What the step's end asks for, agreed over all ranks."""

    evaluate: bool = False
    checkpoint: bool = False
    export: bool = False
    stop: bool = False
    rollback: bool = False


# ---------------------------------------------------------------------------------------------
# The loop


def train(state: TrainerState, loop: Loop) -> TrainerState:
    """Train from `state.step` to `state.max_steps`, then checkpoint, evaluate and export."""
    control = Control()
    samples = loop.samples = SampleIterator(loop.data.train, state.samples_seen, loop.data_state)
    meter = IntervalMeter(loop.device)
    loop.totals = LaunchTotals(first_step=state.step)
    state.model.train()
    loop.callbacks.on_train_start(state, control)
    with ProgressDisplay(loop.settings.progress and state.is_main_process, state.max_steps, state.step) as display, \
            _stop_on_sigterm(loop.stop_signal):
        while state.step < state.max_steps:
            metrics, requests = step_once(state, control, loop, samples, meter)
            display.update(state.step, _progress_info(metrics))
            maybe_evaluate(state, control, loop, requests.evaluate)
            if requests.stop:
                maybe_log(state, loop, meter, force=True)  # before the checkpoint a resume starts from
            maybe_checkpoint(state, control, loop, requests.checkpoint or requests.stop)
            maybe_export(state, loop, requests.export)
            if requests.rollback:
                with loop.progress.during("checkpoint"):
                    rollback(state, loop)
                samples = loop.samples = SampleIterator(loop.data.train, state.samples_seen, loop.data_state)
                meter = IntervalMeter(loop.device)  # the rolled-back steps' partial interval is void
            if control.lr_scale is not None:  # after a rollback, which restores the checkpoint's scale
                set_lr_scale(state, loop, control.lr_scale)
                control.lr_scale = None
            if requests.stop:
                logger.info("stopping at step %d on request (checkpointed)", state.step)
                break
    maybe_log(state, loop, meter, force=True)  # the steps since the last record: a resume starts a new interval
    if state.step >= state.max_steps:
        finish(state, control, loop)
    loop.callbacks.on_train_end(state, control)
    return state


def step_once(state: TrainerState, control: Control, loop: Loop, samples: SampleIterator,
              meter: IntervalMeter) -> tuple[dict[str, Any] | None, Requests]:
    """One optimizer step with its callbacks, committed and logged; the requests agreed at its end
    (bench/bench_orchestrator.py times exactly this)."""
    apply_knob_changes(state, control, loop)
    loop.progress.step_begins(state.step + 1)
    loop.callbacks.on_step_start(state, control)
    step_batch = samples.next_batch(state.knobs.samples_per_step)
    started = time.perf_counter()
    stats = run_step(state, control, loop, step_batch)
    commit_step(state, samples)
    loop.progress.step_done()
    seconds = time.perf_counter() - started
    meter.add(stats, seconds, state.tokens_per_step)
    loop.totals.add(seconds, state.tokens_per_step)
    metrics = maybe_log(state, loop, meter)
    loop.callbacks.on_step_end(state, control, metrics=metrics)
    return metrics, agree_requests(state, control, loop)


def run_step(state: TrainerState, control: Control, loop: Loop, step_batch: dict[str, torch.Tensor]) -> StepStats:
    """train_step, redone on the same samples after an OOM when a callback asks for it."""
    state.attempt = 0
    while True:
        try:
            return train_step(state, control, loop, step_batch)
        except OOM_ERRORS as error:
            control.retry_step = False
            loop.callbacks.on_oom(state, control, error=error)
            if not control.retry_step:
                raise
            logger.warning("out of memory in step %d (micro-batch %d): retrying with %s", state.step + 1,
                           state.micro_step, control.change_knobs or "the same knobs")
        # outside the except block: the traceback, and the activations its frames hold, are gone
        control.retry_step = False
        recover_from_oom(state, loop, step_batch)
        old = state.knobs
        apply_knob_changes(state, control, loop)
        if state.knobs.samples_per_step != old.samples_per_step:
            raise AdaptiveError(
                f"a retried step must keep its samples: micro_batch_size x gradient_accumulation_steps / pieces "
                f"per block was {old.samples_per_step} blocks, now {state.knobs.samples_per_step}"
            )
        state.attempt += 1


def train_step(state: TrainerState, control: Control, loop: Loop, step_batch: dict[str, torch.Tensor]) -> StepStats:
    """One optimizer step: forward/backward over the micro-batches, then the update (or discard)."""
    engine = state.model
    micro_batches = step_micro_batches(step_batch, state.knobs, loop)
    if state.knobs.pp_size > 1:
        return _pipeline_step(state, control, loop, micro_batches)
    count = len(micro_batches)  # the accumulation; sp x that under Ulysses (every SP rank's micro-batches in turn)
    loss_count = _step_target_count(micro_batches, state, loop)
    stats = StepStats.zeros(loop.device)
    progress = loop.progress
    for i, batch in enumerate(micro_batches):
        state.micro_step = i
        progress.phase = "forward"
        batch = {k: v.to(loop.device, non_blocking=True) for k, v in batch.items()}
        engine.set_gradient_accumulation_boundary(i == count - 1)
        # Without the logits (tokens x vocab, 16-bit): nothing reads them after the loss, and holding
        # them through backward costs memory the plan does not count (adaptive measure holds the same).
        outputs = replace(engine(**batch, **(loss_count or _loss_count(batch, loop))), logits=None)
        loss = outputs.loss
        progress.phase = "backward"
        scale = loop.sequence_shards.gradient_scale if loop.sequence_shards is not None else 1.0
        engine.backward(loss * (scale / count), scale_wrt_gas=False)
        if loop.sequence_shards is not None:  # this shard's part of the sequence's loss: log the whole
            loss = loop.sequence_shards.group_loss(loss)
        stats.add(outputs, loss)
        loop.callbacks.on_backward_end(state, control, outputs=outputs, loss=loss.detach(), batch=batch)
        del outputs, loss
    progress.phase = "optimizer"
    skip = agree_any(state, [control.skip_step], extra=~stats.finite())[0]
    control.skip_step = False
    log_step = _is_log_step(state.step + 1, loop)
    norm = None
    state.last_skip = "discarded" if skip else None
    if skip:
        engine_internals.discard_gradients(engine, _probe(step_batch, state.knobs, loop))
        state.skipped_steps += 1
        logger.warning("step %d skipped: gradients discarded (non-finite loss or a callback asked)", state.step + 1)
    else:
        if log_step and not engine_internals.reports_grad_norm(engine):
            norm = _local_grad_norm(engine)
        engine.step()
        _after_update(state, control, loop)
    state.scheduler.step()
    _apply_lr_scale(state, loop)
    state.last_grad_norm = None if skip else (norm if norm is not None else engine_internals.reported_grad_norm(engine))
    return stats


def _pipeline_step(state: TrainerState, control: Control, loop: Loop,
                   micro_batches: list[dict[str, torch.Tensor]]) -> StepStats:
    """DeepSpeed's pipeline schedule runs the step, update included (pipeline_step.py), then the callbacks see each
    micro-batch's loss and router statistics; a skip asked for cannot discard it."""
    from adaptive.train.run import pipeline_step

    loop.progress.phase = "pipeline"  # forward, backward and the update, interleaved inside the schedule
    stats, outputs = pipeline_step.train_batch(state.model, micro_batches, loop.device)
    loop.progress.phase = "optimizer"
    for i, (batch, out) in enumerate(zip(micro_batches, outputs)):
        state.micro_step = i
        loop.callbacks.on_backward_end(state, control, outputs=out, loss=out.loss, batch=batch)
    if control.skip_step:
        logger.warning("step %d: a skip was asked for, but DeepSpeed's pipeline schedule applies the update "
                       "itself; the step ran", state.step + 1)
        control.skip_step = False
    state.last_skip = None
    _after_update(state, control, loop)
    state.scheduler.step()
    _apply_lr_scale(state, loop)
    state.last_grad_norm = engine_internals.reported_grad_norm(state.model) if _is_log_step(state.step + 1, loop) else None
    return stats


def _after_update(state: TrainerState, control: Control, loop: Loop) -> None:
    """The callbacks hear of an applied update; an update DeepSpeed skipped itself (an fp16 overflow) is counted."""
    if state.model.was_step_applied():
        loop.callbacks.on_optimizer_step(state, control)
    else:
        state.skipped_steps += 1
        state.last_skip = "overflow"


def step_micro_batches(step_batch: dict[str, torch.Tensor], knobs: Knobs, loop: Loop) -> list[dict[str, torch.Tensor]]:
    """The step's micro-batches, in order; under Ulysses this rank's shards of its SP group's micro-batches."""
    micro = knobs.micro_batch_size
    sequences = cut_blocks(step_batch, knobs)
    batches = [{k: v[i * micro:(i + 1) * micro] for k, v in sequences.items()}
               for i in range(knobs.gradient_accumulation_steps)]
    return batches if loop.sequence_shards is None else loop.sequence_shards.shard(batches)


def _step_target_count(micro_batches: list[dict[str, torch.Tensor]], state: TrainerState,
                       loop: Loop) -> dict[str, Any]:
    """A fine-tune's loss is the mean over the step's target tokens on all ranks, as transformers' Trainer takes it
    (`num_items_in_batch`): each micro-batch's summed token loss over the step's mean count per micro-batch, so an
    example with a longer answer weighs more, and a micro-batch with no answer token adds 0, not 0/0. The count
    per micro-batch is the mean over every rank (a TP group's copies cancel out), so the micro-batches' mean loss,
    averaged by DeepSpeed over the data-parallel ranks, is the step's token mean. Pretraining blocks hold the same
    count in every micro-batch, where this is each one's own mean: they keep it (and its collective-free step)."""
    if loop.run.finetune is None or loop.sequence_shards is not None or state.knobs.pp_size > 1:
        return {}
    targets = sum((b["labels"][:, 1:] != -100).sum() for b in micro_batches).to(loop.device, torch.float32)
    processes = state.accelerator.num_processes
    if processes > 1:
        targets = state.accelerator.reduce(targets, reduction="sum")
    return {"num_items_in_batch": targets / (len(micro_batches) * processes)}


def _loss_count(batch: dict[str, torch.Tensor], loop: Loop) -> dict[str, Any]:
    """Under Ulysses the shard's loss is over the SP group's label count (sequence_parallel.py)."""
    if loop.sequence_shards is None:
        return {}
    return {"num_items_in_batch": loop.sequence_shards.label_count(batch)}


def cut_blocks(step_batch: dict[str, torch.Tensor], knobs: Knobs) -> dict[str, torch.Tensor]:
    """The step's blocks [N, block_len] as sequences [N * k, seq_len]: each block cut into its k
    consecutive pieces, in order (a view; k = 1 returns the batch as it is)."""
    k = knobs.pieces_per_block
    if k == 1:
        return step_batch
    out = {}
    for key, value in step_batch.items():
        assert value.dim() >= 2 and value.shape[1] == knobs.block_len, (key, tuple(value.shape), knobs.block_len)
        out[key] = value.reshape(value.shape[0] * k, knobs.seq_len, *value.shape[2:])
    return out


def commit_step(state: TrainerState, samples: SampleIterator) -> None:
    """The step is done: count it and commit the data position (and the loader state after the step's batch)."""
    state.step += 1
    state.tokens_seen += state.tokens_per_step
    samples.commit()
    state.samples_seen = samples.position
    state.micro_step = 0
    state.attempt = 0


# ---------------------------------------------------------------------------------------------
# Named steps around train_step


def maybe_log(state: TrainerState, loop: Loop, meter: IntervalMeter, force: bool = False) -> dict[str, Any] | None:
    """A train record on log steps; `force`: now, for the steps since the last one (a stop, the end)."""
    if not (_is_log_step(state.step, loop) or force) or not meter.steps:
        return None
    reduced = meter.reduce(state.accelerator)
    record = train_record(
        step=state.step, tokens_seen=state.tokens_seen, reduced=reduced, lr=current_lr(loop),
        grad_norm=state.last_grad_norm, skipped_steps=state.skipped_steps,
        flops_per_token=loop.run.flops_per_token_at(state.knobs.seq_len), peak_tflops=loop.run.peak_tflops,
        num_gpus=state.world_size, memory=cuda_memory(loop.device),
        knobs={k: getattr(state.knobs, k) for k in Knobs.RUNTIME}, rss_bytes=peak_rss_bytes(),
    )
    loop.metrics.write(record)
    loop.last_train = record
    loop.peak_memory_bytes = max(filter(None, (loop.peak_memory_bytes, peak_bytes(record))), default=None)
    logger.info(_log_line(record))
    return record


def _due(state: TrainerState, every: int, requested: bool) -> bool:
    """Asked for, or a multiple of `every` before the last step (which finish() handles)."""
    return requested or (every > 0 and state.step % every == 0 and state.step < state.max_steps)


def maybe_evaluate(state: TrainerState, control: Control, loop: Loop, requested: bool) -> dict[str, Any] | None:
    control.should_evaluate = False
    return evaluate(state, control, loop) if _due(state, loop.settings.eval_every, requested) else None


def evaluate(state: TrainerState, control: Control, loop: Loop) -> dict[str, Any]:
    """Token-weighted LM loss (aux losses excluded) over this rank's eval blocks, reduced over ranks.
    Whole blocks (the block length) whatever seq_len is in force: no gradients are kept, and the
    loss stays comparable across the run."""
    with loop.progress.during("eval"):
        return _evaluate(state, control, loop)


def _evaluate(state: TrainerState, control: Control, loop: Loop) -> dict[str, Any]:
    engine = state.model
    batches = list(eval_batches(loop.data.eval, state.knobs.micro_batch_size))
    pipelined = state.knobs.pp_size > 1
    if pipelined:  # the pipeline's buffers have the first micro-batch's shape: whole micro-batches only
        batches = [b for b in batches if b["input_ids"].shape[0] == state.knobs.micro_batch_size]
    count = agree_min(state, len(batches))  # every rank runs the same forwards (collectives inside)
    total = torch.zeros(2, dtype=torch.float64, device=loop.device)
    if pipelined and count:
        from adaptive.train.run.pipeline_step import eval_loss

        tokens = sum((b["labels"][:, 1:] != -100).sum() for b in batches[:count]).to(loop.device).double()
        # every batch has the same labels count (whole blocks): the mean over batches is the token-weighted mean
        total += torch.stack([eval_loss(engine, batches[:count], loop.device) * tokens, tokens])
        # a pipeline's stages hold the same loss: count one stage per replica
        total /= state.knobs.pp_size
        batches = []
    engine.eval()
    with torch.no_grad():
        for batch in batches[:count]:
            batch = {k: v.to(loop.device) for k, v in batch.items()}
            out = engine(**batch)
            aux = getattr(out, "aux_loss", None)  # transformers' classes (a fine-tune) may have none
            lm = out.loss - aux if aux is not None else out.loss
            tokens = (batch["labels"][:, 1:] != -100).sum()
            total += torch.stack([lm.double() * tokens, tokens.double()])
    engine.train()
    if state.accelerator.num_processes > 1:
        total = state.accelerator.reduce(total, reduction="sum")
    loss_sum, tokens = total.tolist()
    eval_loss = loss_sum / tokens if tokens else float("nan")
    tokens /= state.knobs.tp_size  # a TP group evaluates one copy of its data (the ratio above counts it tp times)
    metrics = {"kind": "eval", "step": state.step, "time": time.time(), "eval_loss": eval_loss,
               "eval_ppl": math.exp(min(eval_loss, 700.0)) if math.isfinite(eval_loss) else None,
               "eval_tokens": int(tokens)}
    loop.metrics.write(metrics)
    loop.last_eval_step, loop.last_eval = state.step, metrics
    logger.info("eval step %d: loss %.4f ppl %.2f (%d tokens)", state.step, eval_loss, metrics["eval_ppl"] or
                float("nan"), int(tokens))
    loop.callbacks.on_eval(state, control, metrics=metrics)
    return metrics


def maybe_checkpoint(state: TrainerState, control: Control, loop: Loop, requested: bool) -> Path | None:
    control.should_checkpoint = False
    return save(state, control, loop) if _due(state, loop.settings.checkpoint_every, requested) else None


def save(state: TrainerState, control: Control, loop: Loop) -> Path:
    with loop.progress.during("checkpoint"):
        return _save(state, control, loop)


def _save(state: TrainerState, control: Control, loop: Loop) -> Path:
    from accelerate.utils import gather_object

    require_finite_weights(state, "checkpointed")
    positions = gather_object([state.samples_seen])
    trainer_state = {
        "model": model_identity(loop.run),
        "step": state.step, "tokens_seen": state.tokens_seen, "skipped_steps": state.skipped_steps,
        "lr_scale": state.lr_scale, "samples_seen": positions, "knobs": state.knobs.as_dict(),
        "max_steps": state.max_steps, "world_size": state.world_size,
        "callbacks": loop.callbacks.state_dict(),  # e.g. the capacity factor the orchestrator set
    }
    # each rank's data state (its position, and the streaming loader's state), as of the last committed step
    data_state = loop.samples.state_dict() if loop.samples is not None else \
        {"position": state.samples_seen, "workers": None, "loader": None}
    rank_files = {ckpt.data_state_file(state.accelerator.process_index): json.dumps(data_state) + "\n"}
    path = ckpt.save_checkpoint(state.accelerator, state.output_dir, state.step, trainer_state,
                                loop.settings.keep_checkpoints, rank_files=rank_files, trained_only=_adapted(loop))
    state.last_checkpoint, state.last_checkpoint_step = path, state.step
    loop.callbacks.on_checkpoint(state, control, path=path)
    return path


def maybe_export(state: TrainerState, loop: Loop, requested: bool) -> Path | None:
    every = loop.settings.export_every
    if not (requested or (every > 0 and state.step % every == 0 and state.step < state.max_steps)):
        return None
    return export(state, loop, state.output_dir / f"{FINAL_EXPORT}-step_{state.step:08d}")


def export(state: TrainerState, loop: Loop, target: Path) -> Path:
    with loop.progress.during("export"):
        return _export(state, loop, target)


def _export(state: TrainerState, loop: Loop, target: Path) -> Path:
    require_finite_weights(state, "exported")
    meta = {"step": state.step, "tokens_seen": state.tokens_seen, "preset": loop.run.preset, "arch": loop.run.arch,
            "knobs": state.knobs.as_dict()}
    if loop.run.transformers_class:  # a fine-tune of transformers' class: adapter/ and the merged hf/
        from adaptive.train.run_folder.finetune_export import export_finetune

        meta["finetune"] = loop.run.finetune.method
        return export_finetune(state.accelerator, state.model, loop.data.tokenizer, target, loop.run.init_from, meta)
    return ckpt.export_hf(state.accelerator, state.model, loop.data.tokenizer, target, meta)


def _adapted(loop: Loop) -> bool:
    """A LoRA/QLoRA run: its checkpoints hold the adapters and their optimizer states, not the frozen base."""
    return loop.run.finetune is not None and loop.run.finetune.adapted


def model_identity(run: RunPlan) -> dict[str, Any]:
    """What a checkpoint must match to be resumed into this run's model (a fine-tune: its method too)."""
    identity = {"preset": run.preset, "arch": run.arch, "params_total": run.plan.counts.total}
    if run.finetune is not None:
        ft = run.finetune
        identity["finetune"] = {"method": ft.method, "rank": ft.lora_rank if ft.adapted else None,
                                "targets": ft.lora_targets if ft.adapted else None}
    return identity


def require_finite_weights(state: TrainerState, verb: str) -> None:
    """Stop, naming the last good checkpoint, when any rank's trained weights (its ZeRO-3 partition) hold NaN or inf:
    nothing non-finite is ever checkpointed or exported. A frozen base is left alone: its NF4 codes, stored as 16-bit
    values under ZeRO-3, can read as NaN."""
    tensors = [getattr(p, "ds_tensor", p) for p in state.model.module.parameters() if p.requires_grad]
    local_bad = ~torch.stack([torch.isfinite(t).all() for t in tensors if t.numel()]).all() if tensors else None
    if not agree_any(state, [False], extra=local_bad)[0]:
        return
    last = state.last_checkpoint
    raise AdaptiveError(f"step {state.step}: the weights hold NaN or inf, so nothing was {verb}; the last good "
                        f"checkpoint is {last if last is not None else 'none (none was written)'}: resume from it "
                        "with a lower --lr")


def finish(state: TrainerState, control: Control, loop: Loop) -> None:
    """The end of a complete run: a final checkpoint, an eval, the HF export."""
    if state.last_checkpoint is None or ckpt.checkpoint_step(state.last_checkpoint) != state.step:
        save(state, control, loop)
    if loop.last_eval_step != state.step:
        evaluate(state, control, loop)
    path = export(state, loop, state.output_dir / FINAL_EXPORT)
    end = {"kind": "end", "step": state.step, "time": time.time(), "export": str(path),
           "export_remote_code": has_remote_code(path), "skipped_steps": state.skipped_steps,
           **end_summary(state, loop)}
    loop.metrics.write(end)
    if state.is_main_process:
        show_block(logger, "run finished", summary_lines(end))


def end_summary(state: TrainerState, loop: Loop) -> dict[str, Any]:
    """The end record's summary numbers (adaptive.train.reporting.summary says how each is taken)."""
    import psutil

    from adaptive.train.run_folder.finetune_export import adapter_target

    totals, run = loop.totals, loop.run
    tokens_per_s = totals.tokens_per_s()
    # the eval's and the export's allocations since the last train record count too
    rss = peak_rss_bytes()
    final = peak_bytes({"memory": cuda_memory(loop.device), "peak_rss_bytes": rss})
    peak = max(filter(None, (loop.peak_memory_bytes, final)), default=None)
    train, evaluated = loop.last_train or {}, loop.last_eval or {}
    try:
        records = read_metrics(loop.metrics.path) if loop.metrics.enabled and loop.metrics.path.exists() else []
    except ValueError:  # a line cut short: the summary goes on without the earlier launches
        records = []
    launches = sum(1 for r in records if r.get("kind") == "start")  # a resume keeps the earlier launches' records
    adapter = adapter_target(state.output_dir / FINAL_EXPORT) if _adapted(loop) else None
    return {
        "wall_seconds": time.time() - psutil.Process().create_time(),
        "train_seconds": totals.seconds, "train_steps": totals.steps, "warmup_seconds": totals.warmup_seconds,
        "train_seconds_total": sum(r.get("train_seconds") or 0.0 for r in records if r.get("kind") == "train"),
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(tokens_per_s, run.flops_per_token_at(state.knobs.seq_len), run.peak_tflops, state.world_size),
        "tokens_seen": state.tokens_seen, "loss": train.get("loss"), "loss_steps": train.get("interval_steps"),
        "eval_loss": evaluated.get("eval_loss"), "eval_ppl": evaluated.get("eval_ppl"),
        "peak_memory_bytes": peak, "peak_memory_kind": "cuda_allocated" if loop.device.type == "cuda" else "cpu_rss",
        "peak_rss_bytes": rss,
        "device": loop.device.type, "launches": max(launches, 1), "first_step": totals.first_step,
        "run_dir": str(state.output_dir), "checkpoint": str(state.last_checkpoint) if state.last_checkpoint else None,
        "adapter": str(adapter) if adapter else None, "finetune": run.finetune.method if run.finetune else None,
    }


# ---------------------------------------------------------------------------------------------
# Control requests


def agree_requests(state: TrainerState, control: Control, loop: Loop) -> Requests:
    """Combine this rank's requests (callbacks, request files, SIGTERM) with every other rank's."""
    export_file = state.output_dir / EXPORT_REQUEST
    stop_file = state.output_dir / STOP_REQUEST
    main = state.is_main_process
    local = [control.should_evaluate, control.should_checkpoint,
             control.should_export or (main and export_file.exists()),
             control.should_stop or loop.stop_signal.is_set() or (main and stop_file.exists()),
             control.rollback_to_checkpoint]
    evaluate_, checkpoint_, export_, stop, rollback_ = agree_any(state, local)
    control.should_export = control.should_stop = control.rollback_to_checkpoint = False
    if main:
        for path, asked in ((export_file, export_), (stop_file, stop)):
            if asked and path.exists():
                path.unlink()
    return Requests(evaluate_, checkpoint_, export_, stop, rollback_)


def agree_any(state: TrainerState, flags: list[bool], extra: torch.Tensor | None = None) -> list[bool]:
    """Each flag true on any rank (one small all-reduce; `extra` is a device bool tensor ORed into
    the first flag without a host sync of its own)."""
    device = state.accelerator.device
    values = torch.tensor([float(f) for f in flags], dtype=torch.float64, device=device)
    if extra is not None:
        values[0] = values[0] + extra.to(device=device, dtype=torch.float64)
    if state.accelerator.num_processes > 1:
        values = state.accelerator.reduce(values, reduction="sum")
    return [v > 0 for v in values.tolist()]


def agree_min(state: TrainerState, value: int) -> int:
    if state.accelerator.num_processes == 1:
        return value
    from accelerate.utils import gather_object

    return min(gather_object([value]))


def apply_knob_changes(state: TrainerState, control: Control, loop: Loop) -> None:
    """Apply control.change_knobs: the engine's batch bookkeeping, checkpointing, the run's files."""
    if not control.change_knobs:
        return
    changes, control.change_knobs = dict(control.change_knobs), {}
    new = state.knobs.changed(changes)
    if new == state.knobs:
        return
    if new.sp_size > 1 and new.micro_batch_size != state.knobs.micro_batch_size:
        raise AdaptiveError(f"micro_batch_size cannot change under sequence parallelism (sp_size {new.sp_size}): "
                            f"DeepSpeed's Ulysses attention is built for {state.knobs.micro_batch_size} sequences")
    shapes = ("micro_batch_size", "gradient_accumulation_steps", "seq_len")
    if new.pp_size > 1 and any(getattr(new, k) != getattr(state.knobs, k) for k in shapes):
        raise AdaptiveError(f"{', '.join(k for k in shapes if getattr(new, k) != getattr(state.knobs, k))} cannot "
                            f"change under --pp-size {new.pp_size}: DeepSpeed's pipeline engine fixes its micro-batches "
                            "and stage buffers when it is built (only the checkpoint policy can change)")
    old, state.knobs = state.knobs, new
    engine = state.model
    if (new.micro_batch_size, new.gradient_accumulation_steps) != (old.micro_batch_size,
                                                                   old.gradient_accumulation_steps):
        # DeepSpeed's own counters (samples, throughput); the loop runs the accumulation itself
        engine_internals.set_batch_sizes(engine, new.micro_batch_size, new.sequences_per_step)
    if new.checkpoint_policy != old.checkpoint_policy:
        apply_checkpointing(state.accelerator.unwrap_model(engine), new.checkpoint_policy)
    logger.info("knobs changed at step %d: %s", state.step,
                {k: (getattr(old, k), getattr(new, k)) for k in changes if getattr(old, k) != getattr(new, k)})
    write_run_files(state, loop)


def set_lr_scale(state: TrainerState, loop: Loop, scale: float) -> None:
    if not scale > 0:
        raise AdaptiveError(f"lr_scale must be positive, got {scale}")
    logger.info("LR scale %.4g -> %.4g at step %d", state.lr_scale, scale, state.step)
    state.lr_scale = scale
    _apply_lr_scale(state, loop, force=True)


def rollback(state: TrainerState, loop: Loop) -> None:
    """Reload the last checkpoint this run wrote or resumed from (a callback asked, e.g. after a loss
    spike); the newest complete one when that is gone. Not simply the newest: after `--resume` from an
    older checkpoint, newer ones belong to the abandoned history."""
    last = state.last_checkpoint
    path = last if last is not None and ckpt.is_complete(last) else ckpt.find_checkpoint("auto", state.output_dir)
    if path is None:
        raise AdaptiveError(f"rollback asked for, but {state.output_dir / ckpt.CHECKPOINTS} has no complete checkpoint")
    before = state.step
    restore(state, loop, path)
    loop.metrics.write({"kind": "rollback", "step": state.step, "from_step": before, "time": time.time(),
                        "checkpoint": str(path)})
    logger.warning("rolled back from step %d to %s", before, path)


def restore(state: TrainerState, loop: Loop, path: Path) -> None:
    """Load a checkpoint into the engine, optimizer, schedule and RNG, and the trainer state. Everything the
    checkpoint must share with this run is checked before anything is loaded."""
    saved = ckpt.read_trainer_state(path)
    if saved["world_size"] != state.world_size:
        raise AdaptiveError(f"checkpoint {path} was written by {saved['world_size']} processes, this run has "
                            f"{state.world_size}; resume with the same number")
    ours = model_identity(loop.run)
    if saved.get("model", ours) != ours:
        theirs = saved["model"]
        raise AdaptiveError(f"checkpoint {path} is of {theirs.get('preset')} {theirs.get('arch')} "
                            f"({theirs.get('params_total')} parameters), this run trains {ours['preset']} {ours['arch']} "
                            f"({ours['params_total']}); resume with its recipe, or pass another --output-dir")
    knobs = checkpoint_knobs(path, saved["knobs"], state.knobs)
    if len(saved["samples_seen"]) != state.world_size:
        raise AdaptiveError(f"checkpoint {path}: trainer_state.json has {len(saved['samples_seen'])} data positions "
                            f"for {state.world_size} processes")
    ckpt.load_checkpoint(state.accelerator, path, trusted=loop.settings.trust_checkpoints, trained_only=_adapted(loop))
    if saved["max_steps"] != state.max_steps:
        logger.warning("the checkpoint's run had max_steps %d, this one %d: the LR schedule follows %d",
                       saved["max_steps"], state.max_steps, state.max_steps)
    state.step, state.tokens_seen = saved["step"], saved["tokens_seen"]
    state.skipped_steps, state.lr_scale = saved["skipped_steps"], saved["lr_scale"]
    state.samples_seen = saved["samples_seen"][state.accelerator.process_index]
    loop.data_state = ckpt.read_data_state(path, state.accelerator.process_index, state.samples_seen)
    state.last_checkpoint, state.last_checkpoint_step = Path(path), state.step
    control = Control(change_knobs={k: getattr(knobs, k) for k in Knobs.RUNTIME})
    apply_knob_changes(state, control, loop)
    _apply_lr_scale(state, loop, force=True)
    loop.callbacks.load_state_dict(saved.get("callbacks") or {})


def checkpoint_knobs(path: Path, saved: dict[str, Any], ours: Knobs) -> Knobs:
    """The checkpoint's knobs; AdaptiveError, in one line, when a fixed one differs from this run's (ZeRO stage,
    ep/sp/tp sizes, the block length: what the saved states and data position are laid out by)."""
    saved = dict(saved)
    if "checkpoint_policy" not in saved and not saved.get("gradient_checkpointing"):
        saved["checkpoint_policy"] = ours.checkpoint_policy  # written before the knob: as planned
    try:
        knobs = Knobs(**saved)
    except TypeError as err:
        raise AdaptiveError(f"checkpoint {path}: trainer_state.json has unusable knobs ({err})") from None
    # the block length (the run's --seq-len) is fixed: the data position counts blocks of it; the
    # seq_len in force is a runtime knob and comes back with the others
    fixed = [k for k in knobs.as_dict() if k not in Knobs.RUNTIME and getattr(knobs, k) != getattr(ours, k)]
    if fixed:
        hint = (f" (--seq-len is the block length: resume with --seq-len {knobs.block_len}; the checkpoint's "
                f"seq_len {knobs.seq_len} is put back in force)" if "block_len" in fixed else "")
        raise AdaptiveError(f"checkpoint {path} was trained with other settings ("
                            + ", ".join(f"{k} {getattr(knobs, k)} vs {getattr(ours, k)}" for k in fixed)
                            + f"); resume with the same ones{hint}")
    return knobs


def set_peak_lr(state: TrainerState, loop: Loop, lr: float) -> None:
    """Make `lr` the schedule's peak from now on: a resumed schedule brings back the checkpoint's, and an
    --lr given with --resume must not be ignored."""
    scheduler = loop.lr_scheduler
    old = scheduler.base_lrs[0]
    if math.isclose(old, lr, rel_tol=1e-9):
        return
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = lr, lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]  # what get_last_lr() reads
    _apply_lr_scale(state, loop, force=True)
    logger.warning("--lr %g replaces the checkpoint's peak learning rate %g from step %d on", lr, old, state.step)


def write_run_files(state: TrainerState, loop: Loop) -> None:
    """plan.json (the plan, the run, the knobs in force) and ds_config.json in the output folder."""
    if not state.is_main_process:
        return
    from adaptive.plan.ds_config.emit import plan_dict

    run = loop.run
    plan_json = with_knobs(plan_dict(replan_for_knobs(run.plan, state.knobs)), state.knobs)
    plan_json["run"] = {**run.summary(), "knobs": state.knobs.as_dict(), "output_dir": str(state.output_dir)}
    ckpt.atomic_write_text(state.output_dir / "plan.json", json.dumps(plan_json, indent=2) + "\n")
    ds = ds_config_for_knobs(run.ds_config, state.knobs, state.world_size)
    ckpt.atomic_write_text(state.output_dir / "ds_config.json", json.dumps(ds, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# DeepSpeed details


def recover_from_oom(state: TrainerState, loop: Loop, step_batch: dict[str, torch.Tensor]) -> None:
    gc.collect()
    if loop.device.type == "cuda":
        torch.cuda.empty_cache()
    engine_internals.discard_gradients(state.model, _probe(step_batch, state.knobs, loop))


def _probe(step_batch: dict[str, torch.Tensor], knobs: Knobs, loop: Loop) -> dict[str, torch.Tensor]:
    if loop.sequence_shards is not None:  # Ulysses runs whole micro-batches: the first one's shard
        batch = step_micro_batches(step_batch, knobs, loop)[0]
        return {**{k: v.to(loop.device) for k, v in batch.items()}, **_loss_count(batch, loop)}
    n = min(16, step_batch["input_ids"].shape[1])  # the first tokens of one block: valid at any seq_len
    return {k: v[:1, :n].to(loop.device) for k, v in step_batch.items()}


def _local_grad_norm(engine: Any) -> float:
    """The gradient norm before clipping, from .grad (ZeRO-0, where DeepSpeed does not report it);
    under expert parallelism it covers this rank's experts."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


def _apply_lr_scale(state: TrainerState, loop: Loop, force: bool = False) -> None:
    """The schedule sets each group's LR from its base every step; scale it after. `force` rewrites the
    LR in force even at scale 1 (a scale that goes back to 1 must undo the last scaled LR now)."""
    if state.lr_scale == 1.0 and not force:
        return
    for group, lr in zip(loop.lr_scheduler.optimizer.param_groups, loop.lr_scheduler.get_last_lr()):
        group["lr"] = lr * state.lr_scale


def current_lr(loop: Loop) -> float:
    return float(loop.lr_scheduler.optimizer.param_groups[0]["lr"])


def _is_log_step(step: int, loop: Loop) -> bool:
    every = loop.settings.log_every
    return every > 0 and step % every == 0


def _log_line(r: dict[str, Any]) -> str:
    parts = [f"step {r['step']}", f"loss {r['loss']:.4f}", f"ppl {r['ppl']:.2f}" if r["ppl"] else "ppl -",
             f"lr {r['lr']:.3g}"]
    if r["tokens_per_s"]:
        parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    if r["mfu"] is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if r["grad_norm"] is not None:
        parts.append(f"grad-norm {r['grad_norm']:.3f}")
    if r["max_vio_max"] is not None:
        parts.append(f"MaxVio {r['max_vio_max']:.2f}")
    if r["dropped_fraction"]:
        parts.append(f"dropped {sum(r['dropped_fraction']) / len(r['dropped_fraction']):.3f}")
    if r["mod_skip_rate"]:
        parts.append(f"MoD skip {sum(r['mod_skip_rate']) / len(r['mod_skip_rate']):.2f}")
    if peak_bytes(r) is not None:
        parts.append(f"mem {peak_bytes(r) / 2**30:.1f} GiB")
    return " | ".join(parts)


def _progress_info(metrics: dict[str, Any] | None) -> str | None:
    return f"loss {metrics['loss']:.3f}" if metrics else None


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # preemption; Slurm's `--signal=USR1@SECONDS` before a time limit


class _stop_on_sigterm:
    """SIGTERM (what schedulers send before preemption) and SIGUSR1 (what Slurm's --signal sends before
    the time limit) set the stop flag: the loop checkpoints after the current step and returns.
    Installed only in the main thread."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, lambda *_: self.event.set()) for sig in STOP_SIGNALS}

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)


__all__ = ["EXPORT_REQUEST", "FINAL_EXPORT", "Loop", "LoopSettings", "STOP_REQUEST", "apply_knob_changes",
           "checkpoint_knobs",
           "evaluate", "maybe_checkpoint", "maybe_evaluate", "model_identity", "require_finite_weights", "restore",
           "rollback", "save", "set_peak_lr",
           "step_once", "train", "train_step", "write_run_files"]
