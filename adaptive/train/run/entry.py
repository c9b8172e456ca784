"""Train one planned run: process group, plan, Accelerator, data, model, resume, loop.

`run(config, preset, arch, ...)` is what a recipe calls after parsing its flags (`adaptive.recipe`).
The orchestrator reaches the loop as a plugin: `plugins()` builds its callbacks when the run has it
on (`--orchestrator on`, or auto and the plan recommends it). This package imports nothing from
`adaptive.orchestrator`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from adaptive.config.run import RunConfig
from adaptive.errors import AdaptiveError
from adaptive.train.run.callbacks import Callback, CallbackList, TrainerState
from adaptive.train.run_folder.ownership import RunLock, check_fresh_start, clear_run, starts_fresh
from adaptive.train.reporting.trackers import resolve as resolve_trackers


def run_dir(config: RunConfig, preset: str, arch: str) -> Path:
    """--output-dir, else runs/PRESET_ARCH (a config.json's shape: its folder's name)."""
    name = Path(preset).expanduser().resolve().parent.name if preset.endswith(".json") else Path(preset).name
    return Path(config.output.output_dir or f"runs/{name}_{arch}")


def check_data(config: RunConfig) -> None:
    """A bad row, or chats the tokenizer cannot render: one line, before anything starts (`adaptive launch` asks
    too, before it writes the run's configs)."""
    from adaptive.train.data.instructions import CHAT, require_chat_template
    from adaptive.train.data.sources import check_local_rows
    from adaptive.train.data.tokenizer import load_tokenizer
    from adaptive.train.run.setup import tokenizer_source

    untokenized_checkpoint(config.model.init_from, config.data.tokenizer)
    if check_local_rows(config.data.dataset, config.data.text_field) == CHAT:
        require_chat_template(load_tokenizer(tokenizer_source(config.data, config.model.init_from)),
                              config.data.dataset)


def untokenized_checkpoint(init_from: str | None, tokenizer: str | None) -> None:
    """A downloaded checkpoint without its tokenizer, and no --tokenizer: refused, not trained on the built-in
    tokenizer's ids (which mean nothing to its embedding). An adaptive export may lack one: it used the built-in."""
    from adaptive.plan.architecture.hf_config import read_config_json
    from adaptive.train.run_folder.init_from import TOKENIZER_FILES, tokenizer_folder

    folder = Path(init_from).expanduser() if init_from else None
    if tokenizer or folder is None or tokenizer_folder(init_from) or not (folder / "config.json").is_file():
        return
    if read_config_json(folder).get("model_type") != "adaptive":
        raise AdaptiveError(f"--init-from {init_from!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}), and "
                            "the built-in one's ids mean nothing to its embedding: download the model's tokenizer "
                            "files into it, or pass --tokenizer DIR")


def run(config: RunConfig, preset: str, arch: str, callbacks: list[Callback] | None = None,
        plugins: Callable[[], list[Any]] | None = None) -> TrainerState:
    """Train. `callbacks` always run, first; `plugins()` (the orchestrator) when the run has it on. The run
    folder is checked, locked, and (with --overwrite) cleared before anything else is written."""
    from adaptive.train.run import setup
    from adaptive.train.reporting.display import configure_logging
    from adaptive.train.run.restart import start_mode
    from adaptive.train.run.runplan import World, check_with_deepspeed, detect_device, launcher_world, plan_run

    out = config.output
    output_dir = run_dir(config, preset, arch)
    if out.resume and out.overwrite:
        raise AdaptiveError("--resume continues the run in --output-dir and --overwrite deletes it; give one of them")
    # a worker the launcher restarted resumes its own run folder (restart.py)
    mode = start_mode(out.resume, out.overwrite, output_dir)
    if mode.check_fresh:
        check_fresh_start(output_dir, mode.resume, mode.overwrite)  # every rank, before anything is written
    check_data(config)
    trackers = resolve_trackers(out.report_to)  # an uninstalled tracker: one line, too
    partial = setup.init_distributed(config.faults.collective_timeout)
    configure_logging(partial.is_main_process)
    world = World(partial.num_processes, min(launcher_world().per_node, partial.num_processes))
    plan = plan_run(config, preset, arch, world, detect_device(config.hardware.gpu))
    check_with_deepspeed(plan.ds_config, world.size)  # a config DeepSpeed refuses: one line, nothing written
    # the ops this config loads (CPU Adam, async_io), compiled now where they must be, said before and after:
    # DeepSpeed compiles them silently inside deepspeed.initialize. Every rank loads them (one compiles, under
    # torch's lock in the op's folder, the others wait for it there rather than at a collective's timeout).
    from adaptive.engine import compile_ops, ops_a_run_loads

    compile_ops(ops_a_run_loads(plan.ds_config), setup.announce if partial.is_main_process else None)
    lock, resume_from = claim_run_folder(partial, output_dir, mode.resume, mode.overwrite)
    try:
        return _train(config, preset, arch, callbacks, plugins, partial, plan, world, output_dir, resume_from,
                      trackers, mode.restart)
    finally:
        if lock is not None:
            lock.release()


def claim_run_folder(partial: Any, output_dir: Path, resume: str | None,
                     overwrite: bool) -> tuple[RunLock | None, Path | None]:
    """The main process locks the folder, clears it (--overwrite) and finds the checkpoint to resume (verified);
    every rank gets the checkpoint, or the same one-line error. A refused --resume changes nothing."""
    from accelerate.logging import get_logger
    from accelerate.utils import broadcast_object_list

    from adaptive.train.run_folder.checkpoint import CHECKPOINTS, find_checkpoint, os_reason

    lock, shared = None, [None, None]  # the checkpoint, the error
    if partial.is_main_process:
        try:
            if starts_fresh(output_dir, resume):
                get_logger(__name__).warning("--resume auto: no checkpoint in %s; starting fresh",
                                             output_dir / CHECKPOINTS)
                resume = None
            if resume:  # looked up before the lock: a refused --resume creates nothing
                path = find_checkpoint(resume, output_dir)
                if path is None:
                    where = output_dir if resume == "auto" else resume
                    raise AdaptiveError(f"--resume: {where} holds no checkpoint that verifies, so nothing was changed; "
                                        "start a fresh run without --resume")
                shared[0] = str(path)
            lock = RunLock(output_dir).acquire()
            if overwrite:
                cleared = clear_run(output_dir)
                if cleared:
                    get_logger(__name__).warning("--overwrite: deleted %s from %s", ", ".join(cleared), output_dir)
        except AdaptiveError as err:
            shared[1] = str(err)
        except OSError as err:
            shared[1] = f"run folder {output_dir}: {os_reason(err)}"
    if partial.num_processes > 1:
        broadcast_object_list(shared)
    if shared[1]:
        if lock is not None:
            lock.release()
        raise AdaptiveError(shared[1])
    return lock, Path(shared[0]) if shared[0] else None


def _train(config: RunConfig, preset: str, arch: str, callbacks: list[Callback] | None,
           plugins: Callable[[], list[Any]] | None, partial: Any, plan: Any, world: Any, output_dir: Path,
           resume_from: Path | None, trackers: list[str], restart: int = 0) -> TrainerState:
    from accelerate.logging import get_logger
    from accelerate.utils import set_seed

    from adaptive.train.reporting import trackers as tracking
    from adaptive import engine as engine_internals
    from adaptive.train.run import setup
    from adaptive.train.run.loop import Loop, LoopSettings, restore, set_peak_lr, train, write_run_files
    from adaptive.train.reporting.metrics import MetricsWriter
    from adaptive.train.reporting.summary import knobs_line
    from adaptive.train.run.faults import append_event, guarded

    main_process = partial.is_main_process
    logger = get_logger(__name__)
    accelerator = setup.make_accelerator(plan, trackers, output_dir)
    setup.quiet_libraries(main_process)
    # a fine-tune's steps are its epochs over the examples, counted once the data is read (below)
    length = (f"{plan.epochs:g} epoch(s)" if plan.epochs is not None else f"{plan.max_steps} steps")
    logger.info("plan: %s %s on %d x %s (%s), %s, DeepSpeed config from %s%s, %s, %d tokens a step",
                preset, arch, world.size, plan.device.gpu.name if plan.device.gpu else "cpu", plan.precision,
                knobs_line(plan.knobs.as_dict()), plan.ds_source.kind,
                f" {plan.ds_source.path}" if plan.ds_source.path else "", length, plan.tokens_per_step)
    logger.info("orchestrator: %s (--orchestrator %s; the plan's advice: %s)", "on" if plan.orchestrator else "off",
                plan.orchestrator_requested, plan.plan.orchestrator.reason)

    opt, out = config.optimizer, config.output
    set_seed(opt.seed)
    data = setup.load_data(config.data, opt.seed, plan, accelerator, plan.plan.request.spec.vocab_size)
    if plan.epochs is not None:  # a fine-tune's length: whole passes over its examples
        samples = getattr(data.train, "samples_per_epoch", None)
        if samples is None:
            raise AdaptiveError("--epochs needs data with a known size (a local file or saved dataset); streamed data "
                                "have none: give --max-steps or --tokens")
        plan = plan.with_epochs(samples)
        logger.info("%g epoch(s) of %d examples: %d steps", plan.epochs, samples, plan.max_steps)
    model = setup.build_model(plan, data.tokenizer, opt.seed, accelerator.device)
    lr = setup.peak_lr(opt.lr, preset) if opt.lr is not None or not plan.finetune else plan.plan.hyperparams.lr
    if plan.finetune:
        from adaptive.plan.search.answer import method_words

        roles = plan.plan.roles
        logger.info("%s; %s of %s parameters trained; peak lr %g (%s)", method_words(plan.finetune),
                    f"{roles.trainable:,}", f"{roles.total:,}", lr,
                    "--lr" if opt.lr is not None else plan.plan.hyperparams.source)
    optimizer = setup.build_optimizer(model, plan.knobs, lr, opt.weight_decay, plan.plan.request.optimizer)
    warmup = opt.warmup_steps if opt.warmup_steps is not None else setup.default_warmup(plan.max_steps)
    lr_scheduler = setup.build_scheduler(optimizer, warmup, plan.max_steps)
    engine, optimizer, scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    if plan.knobs.pp_size > 1 and not engine_internals.reports_grad_norm(engine):  # ZeRO-0, fp32: keep DeepSpeed's norm
        engine_internals.keep_fp32_clip_norm(engine)

    accelerator.wait_for_everyone()
    state = TrainerState(max_steps=plan.max_steps, knobs=plan.knobs, output_dir=output_dir, plan=plan.plan,
                         orchestrator=plan.orchestrator, accelerator=accelerator, model=engine, optimizer=optimizer,
                         scheduler=scheduler, world_size=world.size)
    chain = CallbackList([*(callbacks or []), *(plugins() if plan.orchestrator and plugins else [])])
    settings = LoopSettings(log_every=out.log_every, eval_every=out.eval_every,
                            checkpoint_every=out.checkpoint_every, keep_checkpoints=out.keep_checkpoints,
                            export_every=out.export_every, progress=out.progress,
                            trust_checkpoints=out.trust_checkpoint)
    metrics = MetricsWriter(output_dir, main_process)
    loop = Loop(run=plan, data=data, callbacks=chain, metrics=metrics, settings=settings, device=accelerator.device,
                lr_scheduler=lr_scheduler)
    if plan.knobs.sp_size > 1:  # prepare() registered DeepSpeed's Ulysses attention and its SP groups
        from adaptive.train.run.sequence_parallel import SequenceShards

        loop.sequence_shards = SequenceShards.from_deepspeed(accelerator.device, engine)
    if resume_from is not None:
        restore(state, loop, resume_from)
        state.resumed_from = resume_from
        if opt.lr is not None:
            set_peak_lr(state, loop, opt.lr)
        logger.info("resumed from %s at step %d", resume_from, state.step)
        if config.model.init_from and not (plan.finetune is not None and plan.finetune.adapted):
            logger.warning("--init-from %s ignored: the checkpoint resumed holds the trained weights",
                           config.model.init_from)  # a LoRA checkpoint holds the adapters: its base is --init-from's
    metrics.truncate_after(state.step if state.resumed_from else None)
    write_run_files(state, loop)
    counts = {"params_total": plan.plan.counts.total, "params_active": plan.plan.counts.active}
    metrics.write({"kind": "start", "step": state.step, **plan.summary(), **counts,
                   "resumed_from": str(state.resumed_from) if state.resumed_from else None,
                   "callbacks": [type(c).__name__ for c in chain.callbacks]})
    state.trackers = metrics.sink = tracking.start(accelerator, output_dir, {**plan.summary(), **counts}, config.flat(),
                                                   state.step if state.resumed_from else None)
    if restart and main_process:
        logger.warning("restart %d: %s", restart, f"resumed from {resume_from} at step {state.step}" if resume_from
                       else "no complete checkpoint yet, started afresh")
        append_event(output_dir, {"kind": "restart", "restart": restart, "step": state.step, "time": time.time(),
                                  "checkpoint": str(resume_from) if resume_from else None})
    try:
        with guarded(output_dir, accelerator.process_index, world.size, restart, loop.progress,
                     config.faults.collective_timeout):
            train(state, loop)
    except BaseException:
        tracking.finish(accelerator)  # the trackers keep what was logged; the error goes on
        raise
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return state


__all__ = ["run", "run_dir"]
