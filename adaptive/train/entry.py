"""Train one planned run: process group, plan, Accelerator, data, model, resume, loop.

`run(config, preset, arch, ...)` is what a recipe calls after parsing its flags (`adaptive.recipe`).
The orchestrator reaches the loop as a plugin: `plugins()` builds its callbacks when the run has it
on (`--orchestrator on`, or auto and the plan recommends it). This package imports nothing from
`adaptive.orchestrator`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from adaptive.config.run import RunConfig
from adaptive.train.callbacks import Callback, CallbackList, TrainerState


def run_dir(config: RunConfig, preset: str, arch: str) -> Path:
    return Path(config.output.output_dir or f"runs/{preset}_{arch}")


def run(config: RunConfig, preset: str, arch: str, callbacks: list[Callback] | None = None,
        plugins: Callable[[], list[Any]] | None = None) -> TrainerState:
    """Train. `callbacks` always run, first; `plugins()` (the orchestrator) when the run has it on."""
    from accelerate.logging import get_logger
    from accelerate.utils import set_seed

    from adaptive.train import setup
    from adaptive.train.checkpoint import find_checkpoint
    from adaptive.train.display import configure_logging
    from adaptive.train.loop import Loop, LoopSettings, restore, train, write_run_files
    from adaptive.train.metrics import MetricsWriter
    from adaptive.train.runplan import World, detect_device, launcher_world, plan_run

    partial = setup.init_distributed()
    main_process = partial.is_main_process
    configure_logging(main_process)
    logger = get_logger(__name__)
    world = World(partial.num_processes, min(launcher_world().per_node, partial.num_processes))
    plan = plan_run(config, preset, arch, world, detect_device(config.hardware.gpu))
    accelerator = setup.make_accelerator(plan)
    setup.quiet_libraries(main_process)
    logger.info("plan: %s %s on %d x %s (%s), knobs %s, DeepSpeed config from %s%s, %d steps of %d tokens",
                preset, arch, world.size, plan.device.gpu.name if plan.device.gpu else "cpu", plan.precision,
                plan.knobs.as_dict(), plan.ds_source.kind, f" {plan.ds_source.path}" if plan.ds_source.path else "",
                plan.max_steps, plan.tokens_per_step)
    logger.info("orchestrator: %s (--orchestrator %s; the plan's advice: %s)", "on" if plan.orchestrator else "off",
                plan.orchestrator_requested, plan.plan.orchestrator.reason)

    opt, out = config.optimizer, config.output
    set_seed(opt.seed)
    data = setup.load_data(config.data, opt.seed, plan, accelerator, plan.plan.request.spec.vocab_size)
    model = setup.build_model(plan, data.tokenizer, opt.seed)
    optimizer = setup.build_optimizer(model, plan.knobs, setup.peak_lr(opt.lr, preset), opt.weight_decay)
    warmup = opt.warmup_steps if opt.warmup_steps is not None else setup.default_warmup(plan.max_steps)
    lr_scheduler = setup.build_scheduler(optimizer, warmup, plan.max_steps)
    engine, optimizer, scheduler = accelerator.prepare(model, optimizer, lr_scheduler)

    output_dir = run_dir(config, preset, arch)
    if main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    state = TrainerState(max_steps=plan.max_steps, knobs=plan.knobs, output_dir=output_dir, plan=plan.plan,
                         orchestrator=plan.orchestrator, accelerator=accelerator, model=engine, optimizer=optimizer,
                         scheduler=scheduler, world_size=world.size)
    chain = CallbackList([*(callbacks or []), *(plugins() if plan.orchestrator and plugins else [])])
    settings = LoopSettings(log_every=out.log_every, eval_every=out.eval_every,
                            checkpoint_every=out.checkpoint_every, keep_checkpoints=out.keep_checkpoints,
                            export_every=out.export_every, progress=out.progress)
    metrics = MetricsWriter(output_dir, main_process)
    loop = Loop(run=plan, data=data, callbacks=chain, metrics=metrics, settings=settings, device=accelerator.device,
                lr_scheduler=lr_scheduler)
    if out.resume:
        path = find_checkpoint(out.resume, output_dir)
        if path is None:
            logger.warning("--resume: no complete checkpoint under %s; starting from step 0", output_dir)
        else:
            restore(state, loop, path)
            state.resumed_from = path
            logger.info("resumed from %s at step %d", path, state.step)
            if config.model.init_from:
                logger.warning("--init-from %s ignored: the checkpoint resumed holds the trained weights",
                               config.model.init_from)
    metrics.truncate_after(state.step if state.resumed_from else None)
    write_run_files(state, loop)
    metrics.write({"kind": "start", "step": state.step, **plan.summary(),
                   "params_total": plan.plan.counts.total, "params_active": plan.plan.counts.active,
                   "resumed_from": str(state.resumed_from) if state.resumed_from else None,
                   "callbacks": [type(c).__name__ for c in chain.callbacks]})
    train(state, loop)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return state


__all__ = ["run", "run_dir"]
