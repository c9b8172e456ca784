"""What a plan writes: the DeepSpeed config, the accelerate config, and the plan as JSON.

Pure functions returning dicts/strings; the CLI writes them. Every ds_config is checked against
DeepSpeed's own `DeepSpeedConfig` in tests/plan/ds_config/test_emit.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from adaptive.durable import atomic_write_text
from adaptive.errors import AdaptiveError
from adaptive.plan.estimate import memory as mem
from adaptive.plan.search.advice import OVERHEAD_SOURCE
from adaptive.plan.hardware.gpus import GPU
from adaptive.plan.estimate.memory import TrainSetup, nvme_setup, reduce_bucket_elements, trained_counts
from adaptive.plan.estimate.optimizers import EIGHT_BIT
from adaptive.plan.architecture.families import resolve_targets
from adaptive.plan.architecture.params import count_params
from adaptive.plan.quality.predict import quality_dict
from adaptive.plan.search.planner import Candidate, Plan, offload_name
from adaptive.plan.search.answer import Answer, answer, budget_answer
from adaptive.plan.search.tight import DEFAULT_HEADROOM_FRACTION, TIGHT_MARGIN

if TYPE_CHECKING:  # a budget's files and JSON; a plain plan's do not import the search for it
    from adaptive.plan.search.budget import BudgetResult

GRADIENT_CLIPPING = 1.0
JSON_SCHEMA_VERSION = 1


def ds_config(setup: TrainSetup, grad_accum: int, gpu: GPU, nvme_path: str | None = None) -> dict:
    """A DeepSpeed config for one setup. The optimizer and LR schedule are built by the training
    loop (torch AdamW or DeepSpeedCPUAdam under offload, transformers' cosine schedule), so the
    file holds only what DeepSpeed itself must know. NVMe offload writes ZeRO-Infinity's sections (nvme.py) for
    `nvme_path`."""
    dp = setup.dp_size  # DeepSpeed counts the batch per data-parallel replica (an SP or TP group is one)
    zero: dict = {"stage": setup.zero_stage}
    if setup.zero_stage > 0:
        zero.update(overlap_comm=True, contiguous_gradients=True,
                    reduce_bucket_size=reduce_bucket_elements(trained_counts(setup, count_params(setup.spec))))
    if setup.zero_stage in (1, 2):
        zero.update(allgather_bucket_size=mem.ALLGATHER_BUCKET_ELEMENTS, reduce_scatter=True)
    if setup.zero_stage == 3:
        zero.update(stage3_prefetch_bucket_size=mem.STAGE3_PREFETCH_ELEMENTS,
                    stage3_max_live_parameters=mem.STAGE3_MAX_LIVE_PARAMETERS,
                    stage3_max_reuse_distance=mem.STAGE3_MAX_LIVE_PARAMETERS,
                    stage3_param_persistence_threshold=100_000,
                    stage3_gather_16bit_weights_on_model_save=True)
        # ZeRO++ (runtime/zero/config.py; read only by ZeRO-3's partitioning and stage3.py)
        if setup.zero_hpz > 1:
            zero["zero_hpz_partition_size"] = setup.zero_hpz
        if setup.zero_quantized_weights:
            zero["zero_quantized_weights"] = True
        if setup.zero_quantized_gradients:
            zero["zero_quantized_gradients"] = True
    if setup.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if setup.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    client = {}
    if setup.optimizer in EIGHT_BIT:
        # bitsandbytes' optimizer is a client optimizer DeepSpeed has not tested with ZeRO (runtime/engine.py asserts
        # without this), and under offload DeepSpeed would otherwise swap it for its own CPU Adam (engine.py)
        client["zero_allow_untested_optimizer"] = True
        if setup.offload_optimizer:
            client["zero_force_ds_cpu_optimizer"] = False
    cfg: dict = {
        "train_batch_size": setup.micro_batch_size * grad_accum * dp,
        "train_micro_batch_size_per_gpu": setup.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": GRADIENT_CLIPPING,
        "zero_optimization": zero,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
        **client,
    }
    if setup.sp_size > 1:
        # Ulysses: DeepSpeedConfig divides the world by it when no mpu is given (runtime/config.py:468);
        # UlyssesSPAttentionHF.register_with_transformers takes the same size
        cfg["sequence_parallel_size"] = setup.sp_size
    if setup.pp_size > 1:
        # the pipeline engine: m = gradient_accumulation_steps micro-batches per step (pipe/engine.py:93). The stage
        # count and partition method are PipelineModule arguments (pipe/module.py:125-133), declared in DeepSpeed's
        # config section too (runtime/config.py:274-281), where our reader takes stages as the plan's pin. No
        # tensor_parallel section: AutoTP's (dp, tp) mesh spans the whole world and fails the engine's
        # data-parallel check (pipe/engine.py:103); tensor parallelism inside a stage runs on the topology's
        # model axis (PipeModelDataParallelTopology), whose size is the plan's tp_size
        cfg["pipeline"] = {"stages": setup.pp_size, "partition": "parameters"}
    elif setup.tp_size > 1:
        # AutoTP training (runtime/tensor_parallel/config.py TPTrainingConfig); deepspeed.initialize shards
        cfg["tensor_parallel"] = {"autotp_size": setup.tp_size}
    if gpu.bf16:
        cfg["bf16"] = {"enabled": True}
    else:
        # T4 and older: fp16 with dynamic loss scaling
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                       "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    if setup.offload_device == "nvme":
        from adaptive.plan.ds_config.nvme import with_nvme

        lora = setup.finetune is not None and setup.finetune.adapted
        cfg = with_nvme(cfg, nvme_setup(setup), nvme_path or "", lora=lora)
    return cfg


# ds_configs/*.json: (ZeRO stage, offload, arch the setup is built for). MoE plans stop at ZeRO-2.
PRESET_DS_CONFIGS = {
    "zero0": (0, "none", "dense"),
    "zero1": (1, "none", "dense"),
    "zero2": (2, "none", "dense"),
    "zero3": (3, "none", "dense"),
    "zero2_offload_optimizer": (2, "optimizer", "dense"),
    "zero3_offload_optimizer": (3, "optimizer", "dense"),
    "zero3_offload_all": (3, "all", "dense"),
    "zero2_moe": (2, "none", "moe"),
}


def preset_ds_configs() -> dict[str, dict]:
    """The checked-in ds_configs/*.json: `ds_config` for each ZeRO/offload preset, with the batch
    sizes and the precision left "auto" for accelerate (or the recipes) to fill per run."""
    from adaptive.plan.hardware.gpus import CATALOG
    from adaptive.plan.architecture.presets import preset_spec

    gpu = CATALOG["a100-80gb"]  # any bf16 GPU: the precision sections are replaced below
    out = {}
    for name, (zero, offload, arch) in PRESET_DS_CONFIGS.items():
        setup = TrainSetup(spec=preset_spec("debug", arch), seq_len=2048, micro_batch_size=1, zero_stage=zero,
                           offload_optimizer=offload in ("optimizer", "all"), offload_params=offload == "all",
                           gradient_checkpointing=False)
        cfg = ds_config(setup, 1, gpu)
        if "reduce_bucket_size" in cfg["zero_optimization"]:  # generic files: not sized to the debug model
            cfg["zero_optimization"]["reduce_bucket_size"] = mem.REDUCE_BUCKET_ELEMENTS
        cfg.update(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
        cfg.pop("bf16", None)
        cfg["bf16"] = {"enabled": "auto"}
        cfg["fp16"] = {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
        out[name] = cfg
    return out


def accelerate_config(setup: TrainSetup, ds_config_path: str) -> dict:
    """accelerate's ClusterConfig fields for a DeepSpeed launch of this setup. Tensor and sequence parallel
    sizes travel in the ds_config (`tensor_parallel.autotp_size`, `sequence_parallel_size`), not in
    accelerate's `parallelism_config`: `accelerate launch` refuses that without FSDP2
    (accelerate/commands/launch.py `_validate_launch_command`)."""
    cfg = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {
            "deepspeed_config_file": ds_config_path,
            "zero3_init_flag": setup.zero_stage == 3,
        },
        "machine_rank": 0,
        "num_machines": setup.num_nodes,
        "num_processes": setup.world_size,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if setup.num_nodes > 1:
        cfg["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
        cfg["main_process_ip"] = "MAIN_NODE_IP"
        cfg["main_process_port"] = 29500
    return cfg


def to_yaml(data: dict, indent: int = 0) -> str:
    """Block-style YAML for nested dicts of scalars (the core install has no YAML library)."""
    lines = []
    pad = "  " * indent
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines.append(to_yaml(value, indent + 1).rstrip("\n"))
        else:
            lines.append(f"{pad}{key}: {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def candidate_dict(c: Candidate) -> dict:
    s = c.setup
    t = c.throughput
    return {
        "zero_stage": s.zero_stage,
        "offload_optimizer": s.offload_optimizer,
        "offload_params": s.offload_params,
        "micro_batch_size": s.micro_batch_size,
        "gradient_accumulation_steps": c.grad_accum,
        "seq_len": s.seq_len,
        "gradient_checkpointing": s.gradient_checkpointing,
        "checkpointing": s.checkpointing,  # off | full | a selective policy (mlp, every:N)
        "kernels": s.kernels,
        "ep_size": s.ep_size,
        "tp_size": s.tp_size,
        "sp_size": s.sp_size,
        "pp_size": s.pp_size,
        "pipeline_bubble_fraction": t.pipeline_bubble_fraction,
        "pipeline_p2p_bytes_per_micro_batch": (2 * s.micro_batch_size * s.seq_len * s.spec.hidden_size
                                               * s.bytes_per_param if s.pp_size > 1 else 0),
        "dp_size": s.dp_size,
        "zero_hpz": s.zero_hpz,
        "zero_quantized_weights": s.zero_quantized_weights,
        "zero_quantized_gradients": s.zero_quantized_gradients,
        "memory": dict(c.memory.parts),
        "memory_phases": {"persistent": c.memory.persistent_bytes, "backward": c.memory.backward_bytes,
                          "optimizer_step": c.memory.step_bytes, "peak_phase": c.memory.peak_phase},
        "activation_bytes": c.memory.saved_bytes,
        "model_state_bytes": c.memory.model_state_bytes,
        "peak_gpu_bytes": c.memory.peak_gpu_bytes,
        "host_bytes": c.memory.host_bytes_per_node,
        "nvme_bytes": c.memory.nvme_bytes_per_node,
        "fits_gpu": c.fits_gpu,
        "fits_host": c.fits_host,
        "tokens_per_second": t.tokens_per_second,
        "mfu_assumed": t.utilisation,  # kept for schema v1: the same figure as hfu_assumed
        "hfu_assumed": t.utilisation,  # hardware FLOPs over compute time: what the per-op model implies, or --mfu
        "mfu_predicted": t.mfu,
        "model_flops_per_token": t.model_flops_per_token,
        "hardware_flops_per_token": t.hardware_flops_per_token,
        "step_seconds": t.step_seconds,
        "step_breakdown_seconds": {"compute": t.compute_seconds, "data_parallel_comm": t.comm_seconds,
                                   "tp_allreduce": t.tp_allreduce_seconds, "sp_alltoall": t.sp_alltoall_seconds,
                                   "moe_alltoall": t.alltoall_seconds, "offload": t.offload_seconds,
                                   "pipeline_bubble": t.pipeline_bubble_seconds,
                                   "pipeline_p2p": t.pipeline_p2p_seconds},
        # compute by kind of work (adaptive/plan/estimate/op_times.py); zeros when --mfu gave a utilisation instead
        "compute_breakdown_seconds": {"matmul": t.matmul_seconds, "attention": t.attention_seconds,
                                      "memory_bound": t.memory_bound_seconds, "launch": t.launch_seconds},
        "kernels_per_step": t.kernels_per_step,
        "data_parallel_comm_total_seconds": t.comm_total_seconds,
    }


def plan_dict(plan: Plan) -> dict:
    """The stable `--json` schema (README documents it)."""
    req = plan.request
    c = plan.shown
    spec = req.spec
    out = {
        "schema_version": JSON_SCHEMA_VERSION,
        "fits": plan.fits,
        "model": spec.name,
        "arch": spec.arch,
        "model_source": spec.source,
        "gpu": req.gpu.name,
        "num_gpus": req.world_size,
        "gpus_per_node": req.gpus_per_node,
        "num_nodes": req.num_nodes,
        "precision": "bf16" if req.gpu.bf16 else "fp16",
        "params_total": plan.counts.total,
        "params_active": plan.counts.active,
        **candidate_dict(c),
        "gpu_capacity_bytes": req.gpu.memory_bytes,
        "host_capacity_bytes": plan.host_mem_bytes,
        "global_batch_tokens": c.setup.seq_len * c.setup.micro_batch_size * c.grad_accum * c.setup.dp_size,
        "train_tokens": plan.train_tokens,
        "train_hours": plan.hours,
        "price_per_gpu_hour": req.gpu.price_per_hour,
        "cost_usd": plan.cost,
        "cost_per_1b_tokens_usd": plan.cost / plan.train_tokens * 1e9,
        "ladder": [{"change": s.change, "peak_gpu_bytes": s.peak_gpu_bytes, "fits": s.fits, "fits_gpu": s.fits_gpu}
                   for s in plan.ladder],
        "orchestrator": {"recommended": plan.orchestrator.recommended, "reason": plan.orchestrator.reason,
                         "measured_overhead": {"time_fraction": plan.orchestrator.overhead_time_fraction,
                                               "memory_bytes": plan.orchestrator.overhead_memory_bytes,
                                               "source": OVERHEAD_SOURCE}},
        "suggestions": list(plan.suggestions),
        "assumptions": assumptions(plan),
        "optimizer": req.optimizer,
        "attention": req.attention,
        "answer": answer_dict(answer(plan)),
        "headroom": headroom_dict(plan),
        "tight": plan.tight,
        "tight_margin": TIGHT_MARGIN,
        "tight_decided_by": plan.tight_part,
        "calibrated": list(req.calibrated),
        "calibration_source": req.calibration_source,
        "ds_config": ds_config_dict(plan),
        "quality": quality_dict(plan.quality) if plan.quality else None,
        "quality_absent_reason": plan.quality_note,
        "hyperparameters": hyperparams_dict(plan),
        "finetune": finetune_dict(plan),
    }
    return out


def answer_dict(a: Answer) -> dict:
    """The first line and its parts (search/answer.py): decided_by is fits | gpu | host | headroom | pin."""
    return {"line": a.line, "verdict": a.verdict, "decided_by": a.decided_by, "reason": a.reason}


def headroom_dict(plan: Plan) -> dict:
    """The GPU memory every candidate kept free, as given or by default, and the faster ones it ruled out."""
    h = plan.request.headroom
    return {"bytes": plan.headroom_bytes, "fraction": h.fraction if h.gib is None else None, "gib": h.gib,
            "given": h.given, "default_fraction": DEFAULT_HEADROOM_FRACTION,
            "ruled_out": [{"zero_stage": c.setup.zero_stage, "offload": offload_name(c.setup),
                           "micro_batch_size": c.setup.micro_batch_size, "checkpointing": c.setup.checkpointing,
                           "peak_gpu_bytes": c.memory.peak_gpu_bytes,
                           "tokens_per_second": c.throughput.tokens_per_second} for c in plan.ruled_out]}


def finetune_dict(plan: Plan) -> dict | None:
    """A fine-tune's method and its split of the parameters (None for pretraining)."""
    ft, roles, s = plan.request.finetune, plan.roles, plan.shown.setup
    if ft is None or roles is None:
        return None
    adapted = ft.adapted
    return {"method": ft.method,
            "rank": ft.lora_rank if adapted else None, "alpha": ft.alpha if adapted else None,
            "dropout": ft.lora_dropout if adapted else None,
            "targets": ft.lora_targets if adapted else None,
            "target_modules": sorted({m.leaf for m in resolve_targets(plan.request.spec, ft.lora_targets)})
            if adapted else None,
            "trainable_params": roles.trainable, "frozen_params": roles.frozen, "base_bits": ft.base_bits,
            "nf4_params": roles.frozen_4bit, "nf4_bytes": roles.nf4_packed_bytes + roles.nf4_state_bytes,
            # PEFT's DeepSpeed guide: ZeRO-3 partitions the 4-bit codes only when stored in the compute dtype
            "bnb_4bit_quant_storage": (("bfloat16" if plan.request.gpu.bf16 else "float16") if s.zero_stage == 3
                                       else "uint8") if ft.quantized else None,
            "epochs": plan.request.epochs, "dataset_tokens": plan.request.unique_tokens}


def hyperparams_dict(plan: Plan) -> dict | None:
    """DeepSeek LLM's compute-optimal batch and learning rate for this run, and what the run uses."""
    h = plan.hyperparams
    if h is None:
        return None
    return {"offered_global_batch_tokens": h.global_batch_tokens, "offered_lr": h.lr, "compute_flops": h.flops,
            "extrapolated": h.extrapolated, "source": h.source, "global_batch_tokens": plan.global_batch_tokens,
            "lr": plan.request.lr}


def budget_dict(result: BudgetResult) -> dict:
    """fit --budget-*'s JSON: the winner's plan, and the budget with the best plan of each arch."""
    b = result.budget
    return {**plan_dict(result.best), "answer": answer_dict(budget_answer(result)), "budget": {
        "usd": b.usd, "gpu_hours": b.gpu_hours, "days": b.days, "hours_bought": result.hours,
        "gpu_hours_bought": result.hours * result.best.request.world_size, "models_planned": result.planned,
        "global_batch_from": "pinned (--global-batch-tokens)" if result.batch_pinned else
        "B_opt of each run's compute (DeepSeek LLM 2024), in power-of-two sequences",
        "winner_is_largest_tried": result.largest_tried,
        "versus_best": [{"arch": v.higher if v.lower == result.best.request.spec.arch else v.lower, "tie": v.tie,
                         "gap": v.gap, "gap_band": list(v.band) if v.band else None, "words": v.words()}
                        for v in result.versus_best],
        "best_per_arch": [run_summary(p) for p in result.by_arch]}}


def run_summary(p: Plan) -> dict:
    """One plan in a line of figures: the model, its tokens, speed, cost and predicted loss."""
    return {"model": p.request.spec.name, "arch": p.request.spec.arch, "params_total": p.counts.total,
            "params_active": p.counts.active, "hidden_size": p.request.spec.hidden_size,
            "num_hidden_layers": p.request.spec.num_hidden_layers, "train_tokens": p.train_tokens,
            "tokens_per_param": p.train_tokens / p.counts.active,
            "global_batch_tokens": p.global_batch_tokens, "tokens_per_second": p.shown.throughput.tokens_per_second,
            "train_hours": p.hours, "cost_usd": p.cost, "predicted_loss": p.quality.predicted_loss,
            "loss_band": list(p.quality.band), "lr": p.hyperparams.lr if p.hyperparams else None}


def write_budget_files(result: BudgetResult, out_dir: str | Path) -> dict[str, Path]:
    """The winner's files (write_plan_files), its model as config.json (`--model OUT` trains that shape), and
    plan.json with the budget's section."""
    from adaptive.plan.architecture.hf_config import adaptive_config_dict

    files = write_plan_files(result.best, out_dir)
    out = Path(out_dir)
    try:
        atomic_write_text(files["plan"], json.dumps(budget_dict(result), indent=2) + "\n")
        model = out / "config.json"
        atomic_write_text(model, json.dumps(adaptive_config_dict(result.best.request.spec), indent=2) + "\n")
    except OSError as e:
        raise AdaptiveError(f"cannot write the plan files into {str(out)!r}: {e.strerror or e}") from None
    return {**files, "model_config": model}


def ds_config_dict(plan: Plan) -> dict | None:
    """What a --ds-config file set, and which memory parts it drives."""
    ds = plan.request.ds_config
    if ds is None:
        return None
    from adaptive.plan.ds_config.reader import drivers

    c = plan.shown
    return {"path": ds.path, "set": [{"knob": k, "from": v} for k, v in ds.sources],
            "ignored": list(ds.ignored),
            "drives": [{"part": part, "bytes": n, "from": why}
                       for part, n, why in drivers(ds, c.memory.parts, c.setup.zero_stage)]}


PARALLELISM_ASSUMPTIONS = (
    "data parallel with ZeRO, expert parallel (MoE), AutoTP tensor parallel inside a node, Ulysses sequence "
    "parallel, ZeRO++ and pipeline parallel (DeepSpeed's pipeline engine on our models as a PipelineModule, "
    "ZeRO-1 at most, tensor parallel inside a stage), as DeepSpeed 0.19.8 runs them. AutoTP's all-reduces and "
    "Ulysses' all-to-alls are not overlapped with compute; ZeRO's collectives are, as overlap_comm and ZeRO-3 "
    "prefetch schedule them. A pipeline runs DeepSpeed's non-interleaved 1F1B schedule: (m + p - 1) slots of "
    "the slowest stage's forward and backward of one micro-batch (m = gradient accumulation steps), so a "
    "bubble of (p - 1)/(m + p - 1); the sends between stages (micro-batch x sequence x hidden, forward and "
    "backward, 1/tp per TP rank; inter-node when the pipeline spans nodes) block and are not overlapped; each "
    "stage's gradient all-reduce runs after the last backward, not overlapped; stages are split by parameters "
    "(DeepSpeed's default), the peak memory is the worst stage's, with min(p - s, m) micro-batches of "
    "activations in flight on stage s (adaptive.plan.estimate.pipeline, throughput)")


def assumptions(plan: Plan) -> dict:
    from adaptive.plan.estimate import throughput as tp
    from adaptive.plan.hardware.figures import NCCL_BUS_EFFICIENCY
    from adaptive.plan.hardware.gpus import figures

    hw = figures(plan.request.gpu.name)
    return {
        "mfu": plan.shown.throughput.utilisation,  # schema v1 name: the hardware utilisation in force
        "hfu": plan.shown.throughput.utilisation,
        "hfu_source": "given (--mfu)" if plan.request.mfu is not None else
        "per-operation model (adaptive/plan/estimate/op_times.py) with the kernel figures below",
        "kernel_figures": asdict(hw.kernels),
        "cuda_context_bytes": mem.CUDA_CONTEXT_BYTES,
        "fragmentation_fraction": mem.FRAGMENTATION,
        "host_mem_bytes_per_node": plan.host_mem_bytes,
        "intranode_gbps_per_gpu": plan.request.gpu.link_gbps,
        "intranode_link": f"{plan.request.gpu.link}; {hw.intra_node_source}",
        "internode_gbps_per_gpu": hw.inter_node_gbps,
        "internode_link": f"{hw.inter_node} ({hw.inter_node_source})",
        "nccl_bus_efficiency": NCCL_BUS_EFFICIENCY,
        "host_link_gbps": tp.HOST_LINK_GBPS,
        "cpu_adam_params_per_second": tp.CPU_ADAM_PARAMS_PER_S,
        "capacity_factor": plan.request.capacity_factor,
        "train_tokens_rule": "given" if plan.request.train_tokens else "20 x active params (Chinchilla)",
        "activations": (f"measured (calibration at seq {plan.request.calibration.seq_len}, scaled per token)"
                        if plan.request.calibration else "formula (adaptive.plan.estimate.activations)"),
        "parallelism": PARALLELISM_ASSUMPTIONS,
    }


def write_plan_files(plan: Plan, out_dir: str | Path) -> dict[str, Path]:
    """ds_config.json, accelerate_config.yaml and plan.json in `out_dir`; returns their paths. A plan that does
    not fit gets plan.json alone (the closest configuration and what would fit): configs to launch a run that
    would not fit are not written."""
    out = Path(out_dir)
    c = plan.shown
    ds_path = out / "ds_config.json"
    acc_path = out / "accelerate_config.yaml"
    plan_path = out / "plan.json"
    if out.exists() and not out.is_dir():
        raise AdaptiveError(f"cannot write the plan files into {str(out)!r}: it is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(plan_path, json.dumps(plan_dict(plan), indent=2) + "\n")
        if not plan.fits:
            return {"plan": plan_path}
        cfg = ds_config(c.setup, c.grad_accum, plan.request.gpu, plan.request.nvme_path)
        atomic_write_text(ds_path, json.dumps(cfg, indent=2) + "\n")
        atomic_write_text(acc_path, to_yaml(accelerate_config(c.setup, str(ds_path.resolve()))))
    except OSError as e:  # a file where the folder should be, no permission, a full disk: bad input, not a crash
        raise AdaptiveError(f"cannot write the plan files into {str(out)!r}: {e.strerror or e}") from None
    return {"ds_config": ds_path, "accelerate_config": acc_path, "plan": plan_path}
