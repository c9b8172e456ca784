"""The entry point every recipe calls: `main(preset, arch)` parses the flags, plans the run with the
same planner as `adaptive fit`, and trains on DeepSpeed through accelerate.

    accelerate launch recipes/b1_mod.py [flags]            # a GPU box
    accelerate launch --use_deepspeed --num_processes 1 recipes/debug_mod.py --max-steps 40   # CPU

`--dry-run` plans and prints the plan as JSON (the run section, the knobs, the DeepSpeed config)
without training; with `--gpu` it imports no torch.

Exit codes: 0 done, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptive.errors import AdaptiveError

if TYPE_CHECKING:
    from adaptive.train.callbacks import Callback, TrainerState


@dataclass(frozen=True)
class RunArgs:
    """The parsed flags (see `build_parser` for what each does)."""

    preset: str
    arch: str
    gpu: str | None = None
    gpus: int | None = None
    nodes: int | None = None
    dataset: str | None = None
    dataset_config: str | None = None
    text_field: str = "text"
    tokenizer: str | None = None
    seq_len: int | None = None
    min_seq_len: int | None = None
    max_steps: int | None = None
    tokens: float | None = None
    output_dir: str | None = None
    resume: str | None = None
    ds_config: str | None = None
    orchestrator: str = "auto"
    orchestrator_policies: str | None = None
    orchestrator_config: str | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    zero: int | None = None
    offload: str | None = None
    checkpointing: bool | None = None
    ep_size: int | None = None
    lr: float | None = None
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    export_every: int = 0
    progress: bool = True
    dry_run: bool = False

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir or f"runs/{self.preset}_{self.arch}")


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser(preset: str, arch: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"recipes/{preset}_{arch}.py",
        description=f"Train the {preset} preset as {arch} on DeepSpeed, sized by the planner. "
                    "Launch with `accelerate launch` (or torchrun / deepspeed); plain python runs one process.",
    )
    where = p.add_argument_group("hardware and plan")
    where.add_argument("--gpu", help="GPU to plan for (catalog name, see `adaptive gpus`); default: detect with "
                       "torch.cuda; without CUDA the run goes to the CPU")
    where.add_argument("--gpus", type=_positive(int), help="--dry-run only: GPUs per node to plan for "
                       "(a real run takes the launcher's)")
    where.add_argument("--nodes", type=_positive(int), help="--dry-run only: nodes to plan for")
    where.add_argument("--ds-config", help="use this DeepSpeed JSON instead of planning one; its \"auto\" "
                       "values are filled from the plan")
    where.add_argument("--orchestrator", choices=("on", "off", "auto"), default="auto",
                       help="adaptive orchestrator: auto follows the plan's recommendation (default auto)")
    where.add_argument("--orchestrator-policies", metavar="LIST",
                       help="comma-separated policies the orchestrator runs: balance, capacity, oom, guard, ep; "
                       "'all' (default) or 'none' (monitor and event log only)")
    where.add_argument("--orchestrator-config", metavar="JSON",
                       help="policy settings as a JSON object or file, e.g. '{\"balance\": {\"rate\": 0.001}, "
                       "\"guard\": {\"bad_steps\": 3}}' (fields: adaptive/orchestrator/*.py configs)")
    where.add_argument("--dry-run", action="store_true", help="plan and print the run as JSON; do not train")
    data = p.add_argument_group("data")
    data.add_argument("--dataset", help="'c4', a hub dataset, a local .txt/.jsonl/.json/.parquet file or folder, or "
                      "'builtin' (the shipped corpus); default: C4 on a GPU with the hub reachable, else builtin")
    data.add_argument("--dataset-config", help="hub dataset config name (C4: en)")
    data.add_argument("--text-field", default="text", help="the text column of json/parquet/hub data (default text)")
    data.add_argument("--tokenizer", help="hub name or local folder; default: the built-in byte-level BPE (2048)")
    data.add_argument("--seq-len", type=_positive(int), help="sequence length (default 2048 on GPUs, 128 on a CPU); "
                      "the data are blocks of it for the whole run (keep it on --resume)")
    data.add_argument("--min-seq-len", type=_positive(int), help="on out-of-memory errors the orchestrator may "
                      "halve the sequence down to this length, cutting each block into pieces (default: never; "
                      "same as --orchestrator-config '{\"oom\": {\"min_seq_len\": N}}')")
    length = data.add_mutually_exclusive_group()
    length.add_argument("--max-steps", type=_positive(int), help="optimizer steps to train")
    length.add_argument("--tokens", type=_positive(float), help="training tokens (default: the plan's, "
                        "20 x active parameters; 100 steps on a CPU)")
    knobs = p.add_argument_group("knobs (pin what the planner would choose)")
    knobs.add_argument("--micro-batch", type=_positive(int), help="micro-batch per GPU")
    knobs.add_argument("--grad-accum", type=_positive(int), help="gradient accumulation steps")
    knobs.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage")
    knobs.add_argument("--offload", choices=("none", "optimizer", "all"), help="CPU offload")
    knobs.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=None,
                       help="activation checkpointing")
    knobs.add_argument("--ep-size", type=_positive(int), help="expert-parallel size (MoE)")
    opt = p.add_argument_group("optimization")
    opt.add_argument("--lr", type=float, help="peak learning rate (default by preset: debug 3e-3, debug_200m "
                     "6e-4, b1 and b7 3e-4)")
    opt.add_argument("--warmup-steps", type=_non_negative, help="linear warmup (default 5%% of the run, <= 2000)")
    opt.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices (default 0.1)")
    opt.add_argument("--seed", type=int, default=0, help="model init and data order (default 0)")
    out = p.add_argument_group("output, checkpoints, logs")
    out.add_argument("--output-dir", help="run folder: metrics.jsonl, plan.json, checkpoints/, hf/ "
                     "(default runs/<preset>_<arch>)")
    out.add_argument("--resume", nargs="?", const="auto", metavar="PATH",
                     help="continue from the newest complete checkpoint of --output-dir, or of PATH")
    out.add_argument("--log-every", type=_positive(int), default=10, help="log line and metrics record every N steps")
    out.add_argument("--eval-every", type=_non_negative, default=0, help="eval every N steps (0: at the end only)")
    out.add_argument("--checkpoint-every", type=_non_negative, default=1000, help="checkpoint every N steps "
                     "(0: at the end only)")
    out.add_argument("--keep-checkpoints", type=_positive(int), default=3, help="checkpoints kept (default 3)")
    out.add_argument("--export-every", type=_non_negative, default=0, help="HF export every N steps into "
                     "hf-step_N/ (0: at the end only; touch <output-dir>/EXPORT for one now)")
    out.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def parse_args(preset: str, arch: str, argv: list[str] | None = None) -> RunArgs:
    ns = build_parser(preset, arch).parse_args(argv)
    return RunArgs(preset=preset, arch=arch, **vars(ns))


def main(preset: str, arch: str, argv: list[str] | None = None, callbacks: list[Callback] | None = None) -> int:
    """Parse, plan, train. Extra `callbacks` run before the orchestrator's policies."""
    args = parse_args(preset, arch, argv)
    try:
        if args.dry_run:
            sys.stdout.write(json.dumps(dry_run(args), indent=2) + "\n")
            return 0
        run(args, callbacks)
    except AdaptiveError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    return 0


def dry_run(args: RunArgs) -> dict[str, Any]:
    """The plan for `args` as JSON: the run section, the plan (adaptive fit's schema), the DeepSpeed config."""
    from adaptive.plan.emit import plan_dict
    from adaptive.train.runplan import World, detect_device, launcher_world, plan_run

    launched = launcher_world()
    per_node = args.gpus or launched.per_node
    world = World(per_node * (args.nodes or launched.nodes), per_node)
    device = detect_device(args.gpu, assume_gpu=True)
    plan = plan_run(args, world, device)
    orchestrator = _orchestrator_config(args)
    return {"run": plan.summary(), "plan": plan_dict(plan.plan), "ds_config": plan.ds_config,
            "orchestrator": {"policies": list(orchestrator.policies), "settings": orchestrator.settings},
            "args": asdict(args)}


def _orchestrator_config(args: RunArgs):
    from adaptive.orchestrator import orchestrator_config

    config = orchestrator_config(args.orchestrator_policies, args.orchestrator_config)
    if args.min_seq_len is None:
        return config
    oom = config.settings.get("oom", {})
    if oom.get("min_seq_len") not in (None, args.min_seq_len):
        raise AdaptiveError(f"--min-seq-len {args.min_seq_len} contradicts oom.min_seq_len {oom['min_seq_len']} in "
                            "--orchestrator-config; give one of them")
    return dataclasses.replace(config, settings={**config.settings, "oom": {**oom, "min_seq_len": args.min_seq_len}})


def run(args: RunArgs, callbacks: list[Callback] | None = None) -> TrainerState:
    """Train: process group, plan, Accelerator, data, model, resume, loop."""
    from accelerate.logging import get_logger
    from accelerate.utils import set_seed

    from adaptive.orchestrator import policies
    from adaptive.train.callbacks import CallbackList, TrainerState
    from adaptive.train import setup
    from adaptive.train.checkpoint import find_checkpoint
    from adaptive.train.display import configure_logging
    from adaptive.train.loop import Loop, LoopSettings, restore, train, write_run_files
    from adaptive.train.metrics import MetricsWriter
    from adaptive.train.runplan import World, detect_device, launcher_world, plan_run

    orchestrator = _orchestrator_config(args)  # bad flags fail before anything starts
    partial = setup.init_distributed()
    main_process = partial.is_main_process
    configure_logging(main_process)
    logger = get_logger(__name__)
    world = World(partial.num_processes, min(launcher_world().per_node, partial.num_processes))
    plan = plan_run(args, world, detect_device(args.gpu))
    accelerator = setup.make_accelerator(plan)
    setup.quiet_libraries(main_process)
    logger.info("plan: %s %s on %d x %s (%s), knobs %s, DeepSpeed config from %s%s, %d steps of %d tokens",
                args.preset, args.arch, world.size, plan.device.gpu.name if plan.device.gpu else "cpu", plan.precision,
                plan.knobs.as_dict(), plan.ds_source.kind, f" {plan.ds_source.path}" if plan.ds_source.path else "",
                plan.max_steps, plan.tokens_per_step)
    logger.info("orchestrator: %s (--orchestrator %s; the plan's advice: %s)", "on" if plan.orchestrator else "off",
                plan.orchestrator_requested, plan.plan.orchestrator.reason)

    set_seed(args.seed)
    data = setup.load_data(args, plan, accelerator, plan.plan.request.spec.vocab_size)
    model = setup.build_model(plan, data.tokenizer, args.seed)
    optimizer = setup.build_optimizer(model, plan.knobs, setup.peak_lr(args), args.weight_decay)
    warmup = args.warmup_steps if args.warmup_steps is not None else setup.default_warmup(plan.max_steps)
    lr_scheduler = setup.build_scheduler(optimizer, warmup, plan.max_steps)
    engine, optimizer, scheduler = accelerator.prepare(model, optimizer, lr_scheduler)

    output_dir = args.run_dir
    if main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    state = TrainerState(max_steps=plan.max_steps, knobs=plan.knobs, output_dir=output_dir, plan=plan.plan,
                         orchestrator=plan.orchestrator, accelerator=accelerator, model=engine, optimizer=optimizer,
                         scheduler=scheduler, world_size=world.size)
    chain = CallbackList([*(callbacks or []), *(policies(orchestrator) if plan.orchestrator else [])])
    settings = LoopSettings(log_every=args.log_every, eval_every=args.eval_every,
                            checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
                            export_every=args.export_every, progress=args.progress)
    metrics = MetricsWriter(output_dir, main_process)
    loop = Loop(run=plan, data=data, callbacks=chain, metrics=metrics, settings=settings, device=accelerator.device,
                lr_scheduler=lr_scheduler)
    if args.resume:
        path = find_checkpoint(args.resume, output_dir)
        if path is None:
            logger.warning("--resume: no complete checkpoint under %s; starting from step 0", output_dir)
        else:
            restore(state, loop, path)
            state.resumed_from = path
            logger.info("resumed from %s at step %d", path, state.step)
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


__all__ = ["RunArgs", "build_parser", "dry_run", "main", "parse_args", "run"]
