"""Every use of DeepSpeed's internals, in one place.

Read against deepspeed 0.19.8 (`runtime/engine.py`, `runtime/zero/stage_1_and_2.py`,
`runtime/bf16_optimizer.py`, `moe/layer.py`, `moe/sharded_moe.py`, `utils/groups.py`,
`runtime/sequence_parallel/`). Nothing here is
DeepSpeed's documented API: `tests/test_engine_internals.py` checks each name against the installed
DeepSpeed, on real objects, and fails naming the one that moved. Upgrading DeepSpeed starts there.

What the rest of the code asks of an engine:
- `discard_gradients`: drop a step's accumulated gradients without an update (a skipped step, an OOM
  retry). DeepSpeed has no public call for it; a non-finite gradient makes its overflow check skip
  the update and clear its buffers.
- `set_batch_sizes`: the micro-batch and global batch in force after the OOM ladder changed them (the
  engine's sample counters and throughput timer read them).
- `reports_grad_norm` / `reported_grad_norm`: the norm DeepSpeed computed for clipping, where it has one.
- MoE: the optimizer param groups DeepSpeed MoE needs, this rank's expert-parallel rank, and the
  all-to-all timers of `MOELayer`.
- Ulysses sequence parallelism: the SP group DeepSpeed built, and its data adapter that shards a batch.
- AutoTP with DeepSpeed MoE: the (data, tensor) mesh before the expert groups, the TP size the MoE layer sees,
  a gloo-safe token gather, and AutoTP's shards gathered on every rank.
- ZeRO-Infinity: whether DeepSpeed's async_io op (NVMe swapping) is compiled here or can be (`nvme_refusal`,
  checked before a run claims its folder), and when its first build is still to come.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

DEEPSPEED_VERSION_READ = "0.19.8"

# What this module relies on, as (module, class or function, name): a method or attribute, `self.x` that
# its source assigns, a parameter of a function, or `method(parameter)`. The test checks each against
# the installed DeepSpeed.
INTERNALS: tuple[tuple[str, str, str], ...] = (
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "set_train_micro_batch_size"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "set_train_batch_size"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "set_gradient_accumulation_boundary"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "was_step_applied"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "get_global_grad_norm"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "self.dp_world_size"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "backward(scale_wrt_gas)"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "self.overflow"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "self._global_grad_norm"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "self._global_grad_norm"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "self.sequence_parallel_size"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "self.reduce_scatter"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "self.contiguous_gradients"),
    ("deepspeed.moe.sharded_moe", "MOELayer", "self.wall_clock_breakdown"),
    ("deepspeed.moe.sharded_moe", "MOELayer", "self.timers"),
    ("deepspeed.moe.sharded_moe", "MOELayer", "self.time_falltoall"),
    ("deepspeed.moe.sharded_moe", "MOELayer", "self.time_salltoall"),
    ("deepspeed.moe.sharded_moe", "MOELayer", "self.time_moe"),
    ("deepspeed.moe.utils", "split_params_into_different_moe_groups_for_optimizer", "param_groups"),
    ("deepspeed.utils.groups", "_get_expert_parallel_rank", "group_name"),
    ("deepspeed.ops.op_builder.cpu.comm", "ShareMemCommBuilder", "NAME"),
    # functions of no parameters: "__call__" checks only that they are there
    ("deepspeed.runtime.sequence_parallel.parallel_state_sp", "get_sequence_parallel_group", "__call__"),
    ("deepspeed.runtime.sequence_parallel.parallel_state_sp", "get_sequence_parallel_rank", "__call__"),
    ("deepspeed.runtime.sequence_parallel.parallel_state_sp", "get_sequence_parallel_world_size", "__call__"),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp", "UlyssesSPDataLoaderAdapter", "__init__(sp_world_size)"),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp", "UlyssesSPDataLoaderAdapter", "refill"),
    ("deepspeed.ops.op_builder.cpu.comm", "ShareMemCommBuilder", "absolute_name"),
    ("deepspeed.utils.groups", "_init_tp_mesh_device", "tensor_model_parallel_size"),
    ("deepspeed.utils.groups", "get_tensor_model_parallel_world_size", "__call__"),
    ("deepspeed.utils.bwc", "bwc_tensor_model_parallel_world_size", "mpu"),
    ("deepspeed.utils.bwc", "bwc_tensor_model_parallel_group", "mpu"),
    ("deepspeed.moe.mappings", "_gather_tokens", "dim"),
    ("deepspeed.moe.layer", "MoE", "__init__(enable_expert_tensor_parallelism)"),
    ("deepspeed.module_inject.layers", "GatherReplacedLayerParams", "__init__(params)"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "clip_fp32_gradients"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "self._global_grad_norm"),
    ("deepspeed.runtime.utils", "clip_grad_norm_", "mpu"),
    ("deepspeed.runtime.pipe.topology", "PipelineParallelGrid", "__init__(topology)"),
    ("deepspeed.ops.op_builder.cpu.async_io", "AsyncIOBuilder", "is_compatible(verbose)"),
    ("deepspeed.ops.op_builder.cpu.async_io", "AsyncIOBuilder", "NAME"),
    ("deepspeed.ops.op_builder.async_io", "AsyncIOBuilder", "is_compatible(verbose)"),
)

# The classes, besides tensors and plain containers, that a DeepSpeed + accelerate checkpoint pickles
# (found by torch.serialization.get_unsafe_globals_in_checkpoint over ZeRO 0-3, MoE and fp16 checkpoints).
# Resume unpickles with torch's weights-only unpickler and allows these alone (train/run_folder/checkpoint.py).
CHECKPOINT_CLASSES: tuple[tuple[str, str], ...] = (
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
)

# MOELayer's forward timers (milliseconds, set when wall_clock_breakdown is on)
A2A_TIMERS = ("time_falltoall", "time_salltoall")
MOE_TIMER = "time_moe"


def checkpoint_classes() -> list[Any]:
    """What a resume may unpickle besides tensors: DeepSpeed's CHECKPOINT_CLASSES and the numpy RNG state
    accelerate saves."""
    import importlib

    import numpy as np

    numpy_rng = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),
                 getattr(getattr(np, "_core", None) or np.core, "multiarray")._reconstruct]
    return [getattr(importlib.import_module(m), name) for m, name in CHECKPOINT_CLASSES] + numpy_rng


# --- DeepSpeed's JIT-compiled ops -----------------------------------------------------------------

# What compiling each op took on 2 CPU cores (measured here, 2026-12-07: ninja's own log of each build), said
# before a build starts: DeepSpeed compiles them silently, inside the call that first needs one.
OP_BUILD_TIMES = {"ShareMemCommBuilder": "about 30 s", "CPUAdamBuilder": "about 2 min",
                  "AsyncIOBuilder": "about 5-15 min"}


def pin_ninja() -> None:
    """Put the `ninja` that DeepSpeed installs (the pip package, a DeepSpeed dependency) first on PATH, for this
    process and the ones it starts. torch builds DeepSpeed's ops with the first `ninja` on PATH, and ninja 1.11
    (Debian's ninja-build) and 1.13 (the pip package) hash a build's command lines differently: an op built by one
    is "command line changed" to the other, so each switch between a PATH with the venv (`accelerate launch` from
    an activated venv) and one without it (`.venv/bin/adaptive launch`, a Slurm job) recompiled every op, silently
    (measured: the shm comm op, twice in a row, 30 s each here and 2.5 min on a loaded machine)."""
    try:
        import ninja
    except ImportError:  # then whichever ninja the machine has is the only one
        return
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != ninja.BIN_DIR:
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


def _op_builder(name: str) -> Any:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder(name)


def op_compiled(name: str) -> bool:
    """DeepSpeed's op `name` (an op builder's class name) is compiled for this DeepSpeed in torch's extension folder
    (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions/py<ver>_<cpu|cuXY>/<op>) and loading it compiles
    nothing: its module is there, its build.ninja names this DeepSpeed's sources (the folder is one per Python and
    CUDA, shared by every environment, and ninja rebuilds an op that another environment's DeepSpeed built), and
    ninja (the one pin_ninja puts first) finds nothing to do."""
    import subprocess

    import deepspeed
    from torch.utils.cpp_extension import _get_build_directory

    builder = _op_builder(name)
    if builder is None:
        return False
    folder = _get_build_directory(builder.NAME, verbose=False)
    ninja_file = os.path.join(folder, "build.ninja")
    if not os.path.exists(ninja_file) or not any(n.startswith(builder.NAME) and n.endswith(".so")
                                                 for n in os.listdir(folder)):
        return False
    with open(ninja_file, encoding="utf-8", errors="replace") as f:
        if os.path.dirname(deepspeed.__file__) not in f.read():
            return False
    try:
        dry = subprocess.run(["ninja", "-n", "-C", folder], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True  # no ninja to ask: torch could not rebuild it either, it loads the module as it is
    return dry.returncode == 0 and "no work to do" in dry.stdout


def ops_a_run_loads(cfg: dict[str, Any]) -> list[str]:
    """The JIT ops (builder class names) DeepSpeed's engine loads for config `cfg`: CPU Adam when the optimizer is
    offloaded (setup.build_optimizer's default there), async_io when anything swaps to NVMe. (On a CPU the process
    group loads the shm comm op before any config: setup.init_distributed compiles it.)"""
    zero = cfg.get("zero_optimization") or {}
    offloaded = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    return (["CPUAdamBuilder"] if offloaded else []) + (["AsyncIOBuilder"] if nvme_offload(cfg) else [])


def compile_ops(names: list[str], say: Callable[[str], None] | None) -> None:
    """Load (compiling where needed) the ops `names`, each that still has to be compiled said before and after
    with its time, through `say` (None on the ranks that keep quiet: torch holds a lock in the op's folder while
    one process compiles it, so the others wait and load it)."""
    for name in names:
        builder = _op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False) or op_compiled(name):
            continue
        if say:
            say(f"DeepSpeed compiles its {builder.NAME} op now, once per machine ({OP_BUILD_TIMES.get(name, 'minutes')}"
                " on 2 CPU cores); later runs load it")
        started = time.monotonic()
        with contextlib.redirect_stdout(io.StringIO()):  # ninja's and DeepSpeed's own build chatter
            builder.load(verbose=False)
        if say:
            say(f"DeepSpeed's {builder.NAME} op compiled in {time.monotonic() - started:.0f} s")


def name_cpu_accelerator() -> bool:
    """Without CUDA, tell DeepSpeed it runs on the CPU through its documented override (`DS_ACCELERATOR`), for this
    process (if it has not imported DeepSpeed yet) and the processes it starts: DeepSpeed would pick the CPU
    anyway, with a warning in every process that imports it. A value the user set is kept. True when this set it."""
    if "DS_ACCELERATOR" in os.environ:
        return False
    import torch

    if torch.cuda.is_available():
        return False
    os.environ["DS_ACCELERATOR"] = "cpu"
    return True


@contextlib.contextmanager
def prints_held(drop: Callable[[str], bool]) -> Iterator[None]:
    """Hold what a DeepSpeed call print()s (it prints some lines instead of logging them) and pass on every line
    but those `drop` picks, which go to the debug log."""
    import logging

    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    finally:
        for line in held.getvalue().splitlines(keepends=True):
            if drop(line):
                logging.getLogger(__name__).debug("DeepSpeed printed: %s", line.rstrip())
            else:
                sys.stdout.write(line)


def shm_comm_op_built_line(line: str) -> bool:
    """The line `deepspeed.comm.torch.build_shm_op` prints whether it compiled the op or loaded a compiled one."""
    return line.startswith("DeepSpeed ") and line.rstrip().endswith("_shm_comm_op built successfully")


def expert_group_line(line: str) -> bool:
    """The line `deepspeed.moe.layer.MoE._create_process_groups` prints when it creates a layer's groups."""
    return line.startswith("No existing process group found, creating a new group named: ep_size_")


# --- ZeRO-Infinity's async I/O op -------------------------------------------------------------------


def nvme_offload(cfg: dict[str, Any]) -> list[str]:
    """The sections of a DeepSpeed config that swap to NVMe (`offload_optimizer`, `offload_param` with device nvme)."""
    zero = cfg.get("zero_optimization") or {}
    return [key for key in ("offload_optimizer", "offload_param") if (zero.get(key) or {}).get("device") == "nvme"]


def async_io_built() -> bool:
    """DeepSpeed's async_io op is compiled for this DeepSpeed here (op_compiled)."""
    return op_compiled("AsyncIOBuilder")


def async_io_unavailable() -> str | None:
    """Why DeepSpeed's async_io op (what ZeRO-Infinity reads and writes its NVMe swap files with) cannot run on this
    machine, in a few words; None when it can: compiled already for this DeepSpeed, or buildable. DeepSpeed builds
    it the first time a run swaps to NVMe, which needs libaio's headers and library (its own check,
    `AsyncIOBuilder.is_compatible`, compiles and links a program calling io_submit against -laio: the system
    package libaio-dev, libaio-devel on RPM systems), a C++ compiler and ninja. A missing libaio otherwise fails
    in deepspeed.initialize, after the model is built and the run folder written."""
    import shutil

    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import is_ninja_available

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None:
        return f"DeepSpeed's {get_accelerator().device_name()} accelerator has no async_io op"
    if async_io_built():
        return None
    if not builder.is_compatible(verbose=False):
        return ("libaio's headers and library were not found (DeepSpeed links a test program with -laio): install "
                "the system package libaio-dev (apt-get install libaio-dev; libaio-devel on RPM systems), or set "
                "CFLAGS and LDFLAGS to where libaio is")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) to build DeepSpeed's async_io op with"
    if not is_ninja_available():
        return "no ninja to build DeepSpeed's async_io op with (pip install ninja)"
    return None


def nvme_refusal(cfg: dict[str, Any]) -> str | None:
    """One line refusing a DeepSpeed config that swaps to NVMe on a machine whose async_io op cannot run; None when
    the config swaps nothing to NVMe or the op can run. Checked before the run folder is claimed."""
    sections = nvme_offload(cfg)
    if not sections:
        return None
    why = async_io_unavailable()
    if why is None:
        return None
    return (f"NVMe offload ({', '.join(sections)} on nvme) needs DeepSpeed's async_io op, which cannot run here: {why}"
            "; nothing was written (`adaptive fit` or the recipe's --dry-run plans it without running it)")


# --- the engine ---------------------------------------------------------------------------------


def discard_gradients(engine: Any, probe: dict[str, Any]) -> None:
    """Drop every gradient accumulated since the last optimizer step, without updating (all ranks).
    `probe` is a one-sample batch the engine can run."""
    if not hasattr(engine.optimizer, "overflow"):  # fp32 ZeRO-0: the torch optimizer, grads in .grad
        engine.zero_grad()
        return
    # Backpropagate a NaN through the probe at the boundary: the gradient becomes non-finite
    # everywhere, and DeepSpeed's overflow check skips the update and clears its buffers. Every token of the probe
    # is made a target: an instruction block's first tokens are its prompt, whose labels are all ignored, and a loss
    # without targets gives zero gradients, NaN-scaled or not (a fine-tune's OOM retry under ZeRO then applied the
    # half-accumulated step).
    engine.set_gradient_accumulation_boundary(True)
    if "labels" in probe:
        probe = {**probe, "labels": probe["input_ids"]}
    out = engine(**probe)
    engine.backward(out.loss * float("nan"), scale_wrt_gas=False)
    engine.step()
    if engine.was_step_applied():
        raise RuntimeError("DeepSpeed applied a step with non-finite gradients (bf16 with check_grad_overflow "
                           "off?); enable bf16.check_grad_overflow to let the loop skip steps")


def set_batch_sizes(engine: Any, micro_batch: int, sequences_per_step: int) -> None:
    """The engine's batch bookkeeping after a live change (the loop runs the accumulation itself)."""
    if engine.dp_world_size is None:  # Ulysses: DeepSpeed's groups give no data-parallel size to count with,
        return  # so its sample counters keep the config's batch (the loop's own records are right)
    engine.set_train_micro_batch_size(micro_batch)
    engine.set_train_batch_size(sequences_per_step * engine.dp_world_size)


def reports_grad_norm(engine: Any) -> bool:
    """Whether the engine's optimizer computes the global gradient norm (ZeRO 1-3, bf16/fp16 wrappers)."""
    return hasattr(engine.optimizer, "_global_grad_norm")


def reported_grad_norm(engine: Any) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if hasattr(norm, "item") else norm)


# --- sequence parallelism (Ulysses) ------------------------------------------------------------


def sequence_parallel_group() -> tuple[Any, int, int]:
    """(group, this rank's place in it, its size): the SP group DeepSpeed's Ulysses registration built."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as sp

    return sp.get_sequence_parallel_group(), sp.get_sequence_parallel_rank(), sp.get_sequence_parallel_world_size()


def ulysses_gradient_scale(engine: Any) -> float:
    """What the loss must be multiplied by under Ulysses for DeepSpeed to leave the data-parallel gradient.

    ZeRO-1/2 and ZeRO-3's all-reduce path divide the summed gradients by world / sp, the data-parallel ranks
    (stage_1_and_2.py average_tensor, stage3.py __avg_scatter_contiguous_grads). ZeRO-3's reduce-scatter path, its
    default (`reduce_scatter`, or gradients that are not contiguous), divides by the whole world
    (comm/coalesced_collectives.py reduce_scatter_coalesced `div_(world_sz)`), ignoring sequence_parallel_size:
    its gradients come out 1/sp of the data-parallel ones (measured: half the gradient norm at sp 2, so clipping
    and Adam's epsilon then train differently)."""
    opt = engine.optimizer
    sp = getattr(opt, "sequence_parallel_size", 1)
    if engine.zero_optimization_stage() == 3 and sp > 1 and (opt.reduce_scatter or not opt.contiguous_gradients):
        return float(sp)
    return 1.0


def ulysses_data_adapter(batches: Any, rank: int, group: Any, size: int, device: Any) -> Any:
    """DeepSpeed's `UlyssesSPDataLoaderAdapter` over `batches` (any iterable with a length): it yields this rank's
    shard of every SP rank's batch in turn, labels shifted before the cut (`shift_labels`), on the CPU."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    return UlyssesSPDataLoaderAdapter(batches, sp_rank=rank, sp_group=group, sp_world_size=size, device=device)


# --- pipeline parallelism with DeepSpeed MoE -----------------------------------------------------


def use_pipeline_grid(pp_size: int) -> None:
    """The pipeline engine's (pipe, data) grid as DeepSpeed's `groups.mpu`, before the expert groups are built on
    it: DeepSpeed then builds each stage's expert-parallel and expert-data-parallel groups inside the stage's ranks
    (utils/groups.py _get_expert_parallel_ranks, pp_stride = world / pp). The engine builds the same grid from the
    PipelineModule's topology (pipe/module.py) and sets it as `groups.mpu` itself (runtime/engine.py
    _configure_distributed_model); expert groups built before either would span the stages."""
    from deepspeed import comm as dist
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid
    from deepspeed.utils import groups

    topology = PipeDataParallelTopology(num_pp=pp_size, num_dp=dist.get_world_size() // pp_size)
    groups.mpu = PipelineParallelGrid(topology=topology)


def keep_fp32_clip_norm(engine: Any) -> None:
    """Under ZeRO-0 in fp32 DeepSpeed clips with `clip_grad_norm_` (runtime/engine.py `clip_fp32_gradients`) and
    drops the norm it returns; keep it as the engine's `_global_grad_norm` (what `get_global_grad_norm` reads, as the
    ZeRO and 16-bit optimizers set it). For the pipeline engine, which steps inside `train_batch`, where the loop
    cannot read the gradients before the update; the norm is DeepSpeed's own, over the stages (`mpu`)."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_fp32_gradients() -> None:
        engine._global_grad_norm = clip_grad_norm_(parameters=engine.module.parameters(),
                                                   max_norm=engine.gradient_clipping(), mpu=engine.mpu)

    engine.clip_fp32_gradients = clip_fp32_gradients


# --- tensor parallelism (AutoTP) with DeepSpeed MoE -----------------------------------------------


def use_tensor_parallel_mesh(tp_size: int) -> None:
    """AutoTP's (data, tensor) mesh, before the expert groups are built on it. deepspeed.initialize makes the
    same two calls (engine.py _configure_tensor_parallel_states, then `groups.mpu = self.mpu`) and finds the
    mesh in place; expert groups built before them would ignore the TP ranks."""
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=tp_size)
    groups.mpu = groups


def tensor_parallel_size() -> int:
    """The TP size DeepSpeed's MoE layer sees (1 until AutoTP's mesh is registered as `groups.mpu`)."""
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

    return bwc_tensor_model_parallel_world_size(groups.mpu)


def _gather_tokens_gloo(input_: Any, dim: int = 0) -> Any:
    """`deepspeed.moe.mappings._gather_tokens` with an output gloo takes. DeepSpeed hands
    all_gather_into_tensor a flat buffer: NCCL accepts it, gloo refuses it ("ProcessGroupGloo::allgather:
    invalid tensor size"). The same gather along dim 0, then laid out along `dim` as DeepSpeed does."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_group

    world = tensor_parallel_size()
    input_ = input_.contiguous()
    if world == 1:
        return input_
    out = torch.empty((world * input_.shape[0], *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    dist.all_gather_into_tensor(out, input_, group=bwc_tensor_model_parallel_group(groups.mpu))
    return out if dim == 0 else torch.cat(out.chunk(world), dim=dim)


def gather_tokens_for_gloo() -> None:
    """Under gloo (CPU runs), MOELayer's tensor-parallel token gather goes through `_gather_tokens_gloo`;
    NCCL runs DeepSpeed's own. Idempotent."""
    import torch.distributed as dist
    from deepspeed.moe import mappings

    if dist.get_backend() == "gloo":
        mappings._gather_tokens = _gather_tokens_gloo


def tensor_parallel_state_dict(model: Any) -> dict[str, Any]:
    """The model's state dict with AutoTP's shards gathered, on every rank of the TP group (a collective).
    DeepSpeed's own (engine._replace_module_consolidated_state_dict) keeps it on global rank 0 only."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    out = {key: value.detach().cpu() for key, value in model.state_dict().items()}  # buffers too
    for prefix, module in model.named_modules():
        params = [(name, p) for name, p in module.named_parameters(recurse=False) if p is not None]
        with GatherReplacedLayerParams([p for _, p in params], module, enabled=True):
            for name, p in params:
                out[f"{prefix}.{name}" if prefix else name] = p.detach().cpu().clone()
    return out


# --- MoE ----------------------------------------------------------------------------------------


def moe_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Optimizer param groups with DeepSpeed MoE's expert parameters split out, as ZeRO needs them."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(groups)


def expert_parallel_rank(ep_size: int) -> int:
    """This process's rank inside its expert-parallel group (DeepSpeed's consecutive-rank layout)."""
    if ep_size == 1:
        return 0
    from deepspeed.utils import groups

    return groups._get_expert_parallel_rank(f"ep_size_{ep_size}")


def moe_layers_with_timers(model: Any) -> list[Any]:
    """DeepSpeed's MOELayer modules (they carry the all-to-all timers)."""
    if model is None:
        return []
    return [m for m in model.modules() if hasattr(m, "wall_clock_breakdown") and hasattr(m, A2A_TIMERS[0])]


def start_moe_timers(layers: list[Any]) -> None:
    """Time the next forwards of `layers` (the timers synchronise the device: sample, do not leave on)."""
    for layer in layers:
        for timer in layer.timers.get_timers().values():
            timer.reset()
        layer.wall_clock_breakdown = True


def stop_moe_timers(layers: list[Any]) -> None:
    for layer in layers:
        layer.wall_clock_breakdown = False


def moe_timer_seconds(layers: list[Any]) -> tuple[float, float]:
    """(forward all-to-all, MoE forward) seconds of the last timed forward, summed over `layers`."""
    a2a = sum(getattr(layer, name) for layer in layers for name in A2A_TIMERS) / 1000.0
    return a2a, sum(getattr(layer, MOE_TIMER) for layer in layers) / 1000.0


def collective_failure(err: BaseException) -> bool:
    """A failure of the process group rather than of this rank's own work: torch's c10d errors (NCCL), or gloo's
    RuntimeError from its transport (a peer's closed connection, a timed-out receive)."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(mark in text for mark in (
        "gloo/transport", "Connection closed by peer", "Connection reset by peer", "Timed out waiting", "NCCL"))


__all__ = ["A2A_TIMERS", "CHECKPOINT_CLASSES", "DEEPSPEED_VERSION_READ", "checkpoint_classes", "INTERNALS", "MOE_TIMER",
           "async_io_built", "async_io_unavailable", "collective_failure", "compile_ops", "OP_BUILD_TIMES", "op_compiled",
           "ops_a_run_loads", "pin_ninja",
           "discard_gradients", "expert_group_line", "expert_parallel_rank", "keep_fp32_clip_norm",
           "name_cpu_accelerator", "nvme_offload", "nvme_refusal", "prints_held",
           "shm_comm_op_built_line",
           "moe_layers_with_timers", "moe_param_groups", "moe_timer_seconds", "reported_grad_norm",
           "reports_grad_norm", "sequence_parallel_group", "set_batch_sizes", "start_moe_timers", "stop_moe_timers",
           "ulysses_data_adapter", "ulysses_gradient_scale", "use_pipeline_grid", "use_tensor_parallel_mesh",
           "tensor_parallel_size", "gather_tokens_for_gloo", "tensor_parallel_state_dict"]
