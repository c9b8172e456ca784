"""Measure real training steps of a real model with fake tensors: no memory, no GPU.

The model class (ours for presets and our exports; transformers' for the config.json files of
adaptive/plan/architecture/families.py) is built under `FakeTensorMode` in 16-bit precision and runs
forward, backward and an AdamW step. A fine-tune (`finetune`: lora, qlora) wraps it in PEFT's LoRA on a
frozen base, as the run does; QLoRA's NF4 base is loaded by bitsandbytes, on real tensors. Two instruments
watch it:

- `torch.autograd.graph.saved_tensors_hooks` counts every tensor autograd keeps for backward
  (unique storages; the model's parameters and buffers, trained or frozen, and their views excluded):
  the activation bytes;
- `PeakBytes`, a dispatch mode that follows every storage's life, gives the live bytes between
  steps (persistent) and the peaks during backward and during the optimizer step.

Model states are laid out the way DeepSpeed does on one GPU (16-bit params; fp32 master weights and
Adam moments; ZeRO-0 builds 16-bit then fp32 gradients for the step; ZeRO-1/2 keep a 16-bit gradient
partition and double-buffered reduce buckets and build fp32 gradients for the step). That layout is
checked against real DeepSpeed engines in tests/plan/estimate/test_memory_measured_deepspeed.py; what this
module measures is the model's own activations, logits and backward working set.

Deep models are measured at two reduced depths and extrapolated per layer: every measured quantity
is linear in the number of layers of a repeating pattern (each layer adds its own activations,
parameters and states; the working set of one layer does not grow with depth).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

try:
    from huggingface_hub.errors import StrictDataclassError  # transformers 5 validates configs with it
except ImportError:  # pragma: no cover - older huggingface_hub
    StrictDataclassError = ValueError

from adaptive.errors import AdaptiveError
from adaptive.plan.architecture.families import peft_target_modules
from adaptive.plan.architecture.hf_config import MOE_TYPES
from adaptive.plan.architecture.presets import ModelSpec, layer_pattern
from adaptive.plan.finetune.method import Finetune

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Phases:
    """Bytes measured in one run (or extrapolated to full depth)."""

    activations: int  # saved for backward at the end of forward
    persistent: int  # live between steps: params, master weights, moments, gradient buffers
    backward: int  # peak during forward+backward, above persistent
    step: int  # peak during the optimizer step, above persistent

    @property
    def peak(self) -> int:
        return self.persistent + max(self.backward, self.step)

    def extrapolate(self, other: "Phases", depth: int, other_depth: int, target: int) -> "Phases":
        """Linear in depth through (depth, self) and (other_depth, other), evaluated at `target`."""
        scale = (target - depth) / (other_depth - depth)
        values = [a + (b - a) * scale for a, b in zip(self.as_tuple(), other.as_tuple())]
        return Phases(*(int(round(v)) for v in values))

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.activations, self.persistent, self.backward, self.step)


@dataclass(frozen=True)
class Measurement:
    phases: Phases
    method: str  # exactly what ran, in words
    depths: tuple[int, ...]  # layer counts actually built
    layers_total: int

    @property
    def peak_bytes(self) -> int:
        return self.phases.peak

    @property
    def activation_bytes(self) -> int:
        return self.phases.activations


class PeakBytes(TorchDispatchMode):
    """Live bytes of every storage created inside the mode, and their peak per phase.

    `torch.distributed._tools.mem_tracker.MemTracker` does the same and sorts bytes into categories,
    but walks every live tensor on each operation: minutes per step for an MoE with thousands of
    expert weights. This counter is O(1) per operation: a finalizer on each storage subtracts it.
    """

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen = WeakIdKeyDictionary()

    def reset_peak(self) -> None:
        self.peak = self.current

    def _release(self, nbytes: int) -> None:
        self.current -= nbytes

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        self._seen[storage] = True
        nbytes = storage.nbytes()
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def is_parameter_view(t: torch.Tensor) -> bool:
    """A trained parameter or a view of one (linear layers save `weight.t()`): not an activation. Without the
    model at hand only; `count_saved_bytes(result, model)` tells parameters by their storage instead."""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


def model_storages(model: torch.nn.Module) -> set[int]:
    """The storages of a model's parameters and buffers, trained or frozen (a LoRA base, bitsandbytes' packed
    4-bit weights): what a saved tensor that is one of them, or a view of one, holds is not an activation."""
    return {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}


@contextlib.contextmanager
def count_saved_bytes(result: dict, model: torch.nn.Module | None = None):
    """Bytes of the unique storages autograd saved (parameters excluded) that are still alive when the
    block ends, into result["bytes"]: what the graph holds at the end of the forward pass.

    With `model`, its parameters and buffers are told by storage, whatever their requires_grad: a frozen weight
    is not an activation, and a leaf activation that requires grad (a frozen embedding's output after
    `enable_input_require_grads`) is one. Without, a leaf that requires grad (or a view of one) is a parameter."""
    seen: dict[int, tuple[weakref.ref, int]] = {}
    params = model_storages(model) if model is not None else None

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params if params is not None else not is_parameter_view(t):
            seen[storage._cdata] = (weakref.ref(storage), storage.nbytes())
        # Detached: a saved *output* that kept its grad_fn would form a node -> saved tensor -> node
        # cycle, keeping the never-run router-statistics branch alive past backward (measured: 180
        # bytes/token in debug MoE). The same storage is kept, so lifetimes are as without the hook.
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    result["bytes"] = sum(nbytes for ref, nbytes in seen.values() if ref() is not None)


def transformers_class_builds(spec: ModelSpec, hf_config: dict | None) -> bool:
    """Whether transformers' class for this config.json is the model planned. A dense config planned
    as our MoE/MoD/hybrid variant of its shape (`--arch`) is built with our class instead."""
    if hf_config is None or hf_config.get("model_type") == "adaptive":
        return False
    return spec.arch == "dense" or hf_config.get("model_type") in MOE_TYPES


def build_model(spec: ModelSpec, hf_config: dict | None, dtype: torch.dtype, checkpointing: bool | str,
                attn_implementation: str = "sdpa", capacity_factor: float = 1.0,
                kernels: str = "lean") -> torch.nn.Module:
    """Our model class for presets, our exports and our variants (with `kernels`); transformers' class
    for other HF configs (its own ops: what "plain" counts)."""
    model = construct_model(spec, hf_config, dtype, attn_implementation, capacity_factor, kernels)
    model.train()
    enable_checkpointing(model, spec, hf_config, checkpointing)
    return model


def construct_model(spec: ModelSpec, hf_config: dict | None, dtype: torch.dtype, attn_implementation: str = "sdpa",
                    capacity_factor: float = 1.0, kernels: str = "lean") -> torch.nn.Module:
    """The model class `build_model` picks, built in `dtype` on the current device, in eval mode."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if transformers_class_builds(spec, hf_config):
            from transformers import AutoConfig, AutoModelForCausalLM

            if capacity_factor != 1.0 and spec.is_moe:
                raise AdaptiveError(f"--capacity-factor {capacity_factor} does not apply to transformers' "
                                    f"{hf_config['model_type']} class, which drops no tokens; leave it at 1.0")
            try:
                cfg = AutoConfig.for_model(**hf_config)
                cfg._attn_implementation = attn_implementation
                model = AutoModelForCausalLM.from_config(cfg)
            except (ValueError, TypeError, StrictDataclassError) as e:
                reason = " ".join(str(e).split())
                raise AdaptiveError(f"transformers cannot build this {hf_config['model_type']} config.json: "
                                    f"{reason}") from None
        else:
            from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM

            overrides = {"capacity_factor": capacity_factor} if spec.is_moe else {}
            overrides["kernels"] = kernels
            cfg = AdaptiveConfig.from_spec(spec, **overrides)
            cfg._attn_implementation = attn_implementation
            model = AdaptiveForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model


def enable_checkpointing(model: torch.nn.Module, spec: ModelSpec, hf_config: dict | None,
                         checkpointing: bool | str) -> None:
    """transformers' own activation checkpointing (non-reentrant; it also makes the embedding's output require
    grad) for its classes, our policies for ours."""
    policy = checkpoint_policy(checkpointing)
    if transformers_class_builds(spec, hf_config) and policy != "off":
        if policy == "mlp":
            raise AdaptiveError(f"checkpointing policy 'mlp' needs adaptive's model class; transformers' "
                                f"{hf_config['model_type']} checkpoints whole layers (full or every:N)")
        every = 1 if policy == "full" else int(policy.split(":")[1])
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                                  every_n_layers=every)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif policy != "off":
        from adaptive.models.checkpointing import apply_checkpointing

        apply_checkpointing(model, policy)


class NativeDropout(torch.nn.Dropout):
    """nn.Dropout as CUDA runs it: aten's fused native_dropout, which keeps a bool mask for backward. On the CPU
    nn.Dropout takes aten's `_dropout_impl` (input * noise) and keeps the noise in the input's dtype: 2 bytes an
    element in 16-bit, where a GPU keeps 1. The planner plans GPUs, so the measurement runs the GPU's op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return torch.native_dropout(x, self.p, True)[0]


def add_lora(model: torch.nn.Module, spec: ModelSpec, finetune: Finetune, dtype: torch.dtype) -> torch.nn.Module:
    """Freeze the model, wrap it in PEFT's LoRA (`finetune`'s rank, alpha, targets and dropout), and cast every
    floating-point parameter to `dtype`, as DeepSpeed's engine does at initialize (`_cast_module_mixed_precision`:
    parameters only). LoRA's dropouts run as on a GPU (`NativeDropout`)."""
    from peft import LoraConfig, get_peft_model

    model.requires_grad_(False)
    config = LoraConfig(r=finetune.lora_rank, lora_alpha=finetune.alpha, lora_dropout=finetune.lora_dropout,
                        target_modules=peft_target_modules(spec, finetune.lora_targets))
    model = get_peft_model(model, config)
    for module in list(model.modules()):
        dropouts = getattr(module, "lora_dropout", None)  # PEFT's LoRA layers: one dropout per adapter
        if isinstance(dropouts, torch.nn.ModuleDict):
            for key, dropout in dropouts.items():
                if type(dropout) is torch.nn.Dropout:
                    dropouts[key] = NativeDropout(dropout.p)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def finetune_model_on_meta(spec: ModelSpec, hf_config: dict | None, dtype: torch.dtype, checkpointing: bool | str,
                           finetune: Finetune, attn_implementation: str = "sdpa",
                           kernels: str = "lean") -> torch.nn.Module:
    """A LoRA fine-tune's model on the meta device (`materialize` gives it storage): built there because PEFT
    moves its adapters with `.to()`, which a module of fake tensors refuses."""
    with torch.device("meta"):
        model = construct_model(spec, hf_config, dtype, attn_implementation, kernels=kernels)
    model.train()
    model = add_lora(model, spec, finetune, dtype)
    _finetune_checkpointing(model, spec, hf_config, checkpointing)
    return model


def _finetune_checkpointing(model: torch.nn.Module, spec: ModelSpec, hf_config: dict | None,
                            checkpointing: bool | str) -> None:
    """Checkpointing as `build_model` enables it, and the embedding's output made to require grad, as a
    fine-tune must for the checkpointed layers' recompute to reach the adapters (transformers' classes do it in
    `activation_checkpointing_enable`)."""
    base = model.get_base_model()
    enable_checkpointing(base, spec, hf_config, checkpointing)
    if checkpoint_policy(checkpointing) != "off" and not transformers_class_builds(spec, hf_config):
        base.enable_input_require_grads()


def materialize(model: torch.nn.Module, device: str = "cpu") -> torch.nn.Module:
    """Give a meta model's parameters and buffers storage on `device` (fake tensors under FakeTensorMode), each
    shared tensor once: tied weights stay tied, as `to_empty` would not keep them."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, wrap in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in made:
                    empty = torch.empty_like(t, device=device)
                    made[id(t)] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) if wrap else empty
                table[name] = made[id(t)]
    return model


def qlora_model(spec: ModelSpec, hf_config: dict | None, dtype: torch.dtype, checkpointing: bool | str,
                finetune: Finetune, attn_implementation: str = "sdpa", kernels: str = "lean") -> torch.nn.Module:
    """A QLoRA fine-tune's model with real tensors: a random checkpoint of the model saved to a temporary folder
    and loaded by transformers with bitsandbytes' NF4 (double quantization, 16-bit compute) on the CPU, then
    LoRA as `add_lora`. bitsandbytes quantizes while loading, so there is no fake-tensor path."""
    import tempfile

    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=dtype)
    from transformers.utils import logging

    model = construct_model(spec, hf_config, dtype, attn_implementation, kernels=kernels)
    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            cls = type(model)
            del model
            model = cls.from_pretrained(folder, quantization_config=quantization, device_map="cpu", dtype=dtype,
                                        attn_implementation=attn_implementation)
    finally:
        if bars:
            logging.enable_progress_bar()
    model.train()
    model = add_lora(model, spec, finetune, dtype)
    _finetune_checkpointing(model, spec, hf_config, checkpointing)
    return model


def checkpoint_policy(checkpointing: bool | str) -> str:
    """True/False (full/off) or a policy name, as a policy name."""
    if isinstance(checkpointing, bool):
        return "full" if checkpointing else "off"
    return checkpointing


class EmulatedZeroOptimizer:
    """DeepSpeed's single-GPU mixed-precision state layout around a fused torch AdamW (module doc)."""

    def __init__(self, model: torch.nn.Module, zero_stage: int, bucket_elements: int | tuple[int, ...]):
        """`bucket_elements`: one size for ZeRO-1/2's two reduce buckets, or the size of each buffer."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().requires_grad_(True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
        self.partitioned = zero_stage in (1, 2, 3)
        self.grad_partition: list[torch.Tensor] = []
        self.buckets: list[torch.Tensor] = []
        # ZeRO-1/2 (one size): DeepSpeed allocates its two reduce buckets at a backward's first gradient
        # and frees them when the backward's reduction ends (stage_1_and_2.py setup_buckets /
        # _release_ipg_buffers); ZeRO-3's buffers (a tuple of sizes) stay allocated.
        self.backward_buckets = () if isinstance(bucket_elements, tuple) else (bucket_elements,) * 2
        if self.partitioned:
            self.grad_partition = [torch.zeros_like(p) for p in self.params]
            self.dtype = self.params[0].dtype
            if isinstance(bucket_elements, tuple):
                self.buckets = [torch.empty(max(n, 1), dtype=self.dtype) for n in bucket_elements]
            for p, g in zip(self.params, self.grad_partition):
                p.register_post_accumulate_grad_hook(_move_grad_into(g))

    def begin_backward(self) -> None:
        if self.partitioned and self.backward_buckets:
            self.reduce_buckets = [torch.empty(max(n, 1), dtype=self.dtype) for n in self.backward_buckets]

    def end_backward(self) -> None:
        # ZeRO-1/2 end a backward holding an averaged copy of the 16-bit gradient partition beside the
        # buckets (measured on DeepSpeed 0.19.8: tests/plan/estimate/test_memory_measured_deepspeed_inputs.py)
        self.averaged = [g.clone() for g in self.grad_partition] if self.backward_buckets else []
        self.reduce_buckets = []

    def step(self) -> None:
        if getattr(self, "averaged", None):
            # DeepSpeed ZeRO-1/2 flatten the averaged partition to 16 bits, convert that to fp32, then
            # free both 16-bit copies before the update (stage_1_and_2.step)
            flat16 = torch.cat([a.reshape(-1) for a in self.averaged])
            flat32 = flat16.float()
            self.averaged = []
            del flat16
            views = torch.split(flat32, [p.numel() for p in self.params])
            for m, v in zip(self.master, views):
                m.grad = v.view_as(m)
            del flat32, views
        else:
            grads = self.grad_partition if self.partitioned else [p.grad for p in self.params]
            for m, g in zip(self.master, grads):
                m.grad = g.float()
        for p in self.params:
            p.grad = None
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
                m.grad = None
            for g in self.grad_partition:
                g.zero_()


def _move_grad_into(buffer: torch.Tensor):
    def hook(p: torch.Tensor) -> None:
        buffer.add_(p.grad)
        p.grad = None

    return hook


@contextlib.contextmanager
def unpacked_sequences():
    """Without a cache (checkpointing turns it off), transformers reads the position ids to detect packed
    sequences, and cannot read fake ones: it then builds an explicit causal mask, which SDPA keeps, and for which it
    repeats k and v to every head (`masking_utils.find_packed_sequence_indices`). Real ids of one sequence a row, as
    here, build no mask: say so, as reading them would."""
    try:
        import transformers.masking_utils as masking
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    original = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def run_phases(spec: ModelSpec, seq_len: int, micro_batch: int, checkpointing: bool | str, *, zero_stage: int = 0,
               dtype: str = "bf16", hf_config: dict | None = None, bucket_elements: int | tuple[int, ...] = 0,
               capacity_factor: float = 1.0, attn_implementation: str = "sdpa", kernels: str = "lean",
               finetune: Finetune | None = None) -> Phases:
    """Two training steps on fake tensors; the second (optimizer states exist by then) is measured. `finetune`
    (lora, qlora) trains PEFT's adapters on a frozen base; QLoRA runs on real tensors (`qlora_model`)."""
    adapted = finetune is not None and finetune.adapted
    real = adapted and finetune.quantized
    meta = None
    if adapted and not real:
        meta = finetune_model_on_meta(spec, hf_config, DTYPES[dtype], checkpointing, finetune, attn_implementation,
                                      kernels)
    with contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True), unpacked_sequences():
        tracker = PeakBytes()
        with tracker:
            if meta is not None:
                model = materialize(meta)
            elif real:
                model = qlora_model(spec, hf_config, DTYPES[dtype], checkpointing, finetune, attn_implementation,
                                    kernels)
            else:
                model = build_model(spec, hf_config, DTYPES[dtype], checkpointing, attn_implementation,
                                    capacity_factor=capacity_factor, kernels=kernels)
            optimizer = EmulatedZeroOptimizer(model, zero_stage, bucket_elements)
            ids = torch.randint(0, spec.vocab_size, (micro_batch, seq_len))
            saved: dict = {}
            for last in (False, True):
                persistent = tracker.current
                tracker.reset_peak()
                # As in our training loop: the output, less its logits, stays alive through backward
                # (the loop reads the router statistics after it), so what the statistics hold counts.
                with count_saved_bytes(saved, model) if last else contextlib.nullcontext():
                    output = replace(model(input_ids=ids, labels=ids), logits=None)
                optimizer.begin_backward()
                output.loss.backward()
                optimizer.end_backward()
                del output
                backward = tracker.peak - persistent
                tracker.reset_peak()
                optimizer.step()
                step = tracker.peak - persistent
    return Phases(activations=saved["bytes"], persistent=persistent, backward=backward, step=step)


def _finetune_words(finetune: Finetune | None) -> str:
    if finetune is None or not finetune.adapted:
        return ""
    base = "a frozen NF4 base (bitsandbytes, double quantization)" if finetune.quantized else "a frozen base"
    dropout = f", dropout {finetune.lora_dropout:g}" if finetune.lora_dropout else ""
    return (f" with PEFT LoRA (rank {finetune.lora_rank}, alpha {finetune.alpha:g}, targets "
            f"{finetune.lora_targets}{dropout}) on {base}")


def _checkpointing_words(checkpointing: bool | str) -> str:
    policy = checkpoint_policy(checkpointing)
    if policy == "off":
        return ""
    return ", full activation checkpointing" if policy == "full" else f", selective checkpointing {policy}"


def reduced(spec: ModelSpec, hf_config: dict | None, depth: int) -> tuple[ModelSpec, dict | None]:
    """The same model with `depth` layers (the per-layer pattern restarted)."""
    shallow = replace(spec, num_hidden_layers=depth, layer_types=tuple(spec.layer_types[:depth]))
    if spec.source == "preset":
        shallow = replace(shallow, layer_types=layer_pattern(spec.arch, depth))
    cfg = None
    if hf_config is not None:
        cfg = dict(hf_config, num_hidden_layers=depth)
        if "block_types" in cfg:
            cfg["block_types"] = list(shallow.layer_types)
        if cfg.get("mlp_only_layers"):
            cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < depth]
    return shallow, cfg


def pattern_period(spec: ModelSpec, hf_config: dict | None) -> int:
    """Layers after which the per-layer pattern repeats."""
    if hf_config and hf_config.get("mlp_only_layers"):
        return spec.num_hidden_layers  # irregular: no shorter period
    types = spec.layer_types
    for period in range(1, len(types) + 1):
        if all(types[i] == types[i % period] for i in range(len(types))):
            return period
    return len(types)


def measure_step(spec: ModelSpec, seq_len: int, micro_batch: int, checkpointing: bool | str, *, zero_stage: int = 0,
                 dtype: str = "bf16", hf_config: dict | None = None, bucket_elements: int | tuple[int, ...] = 0,
                 full_depth: bool = False, capacity_factor: float = 1.0,
                 attn_implementation: str = "sdpa", kernels: str = "lean",
                 finetune: Finetune | None = None) -> Measurement:
    """Measure at full depth, or at two depths (2 and 4 repeats of the layer pattern) extrapolated.
    `kernels` applies to our class; transformers' classes run their own (plain) ops. `finetune` (lora, qlora):
    PEFT's LoRA on the frozen model (`run_phases`)."""
    if not transformers_class_builds(spec, hf_config):
        hf_config = None  # our class, built from the spec
    kw = dict(zero_stage=zero_stage, dtype=dtype, hf_config=hf_config, bucket_elements=bucket_elements,
              capacity_factor=capacity_factor, attn_implementation=attn_implementation, kernels=kernels,
              finetune=finetune)
    total = spec.num_hidden_layers
    period = pattern_period(spec, hf_config)
    policy = checkpoint_policy(checkpointing)
    if policy.startswith("every:"):  # checkpointed layers 0, N, 2N, ...: the pattern repeats every lcm layers
        period = math.lcm(period, int(policy.split(":")[1]))
        full_depth = full_depth or total % period != 0  # a partial last period does not extrapolate
    d1, d2 = 2 * period, 4 * period
    name = hf_config["model_type"] if hf_config and hf_config.get("model_type") != "adaptive" else "adaptive"
    ops = f" with {kernels} kernels" if name == "adaptive" else ""
    tensors = "real tensors (bitsandbytes quantizes while loading)" if finetune and finetune.quantized else \
        "fake tensors (no memory)"
    what = (f"the {name} model class{ops}{_finetune_words(finetune)} on {tensors}, {dtype}, micro-batch "
            f"{micro_batch} x sequence {seq_len}{_checkpointing_words(checkpointing)}"
            f"{', eager attention' if attn_implementation == 'eager' else ''}"
            f"{f', MoE capacity factor {capacity_factor:g}' if spec.is_moe and hf_config is None else ''}"
            f"{f', MoD capacity {spec.mod_capacity:g}' if spec.is_mod else ''}: two training steps "
            f"(forward, backward, fused AdamW on fp32 master weights) in DeepSpeed ZeRO-{zero_stage}'s one-GPU "
            f"state layout; activations from saved_tensors_hooks, bytes from a storage-lifetime counter")
    lean_ours = kernels == "lean" and hf_config is None
    if (zero_stage == 0 or lean_ours) and not full_depth and total > d2:
        # The backward peak is a maximum of moments that grow differently with depth, not linear in it:
        # ZeRO-0's activations still held plus 16-bit gradients already accumulated (extrapolated b7 read
        # 13.05 GiB, all 32 layers 13.50 GiB); with lean kernels also the chunked loss's working set at the
        # start of backward (debug_200m dense, ZeRO-2: extrapolated from 2 and 4 layers -13.7%)
        full_depth = True
        what += f"; the backward peak of {'ZeRO-0' if zero_stage == 0 else 'the lean kernels'} does not extrapolate with depth"
    if full_depth or total <= d2:
        phases = run_phases(spec, seq_len, micro_batch, checkpointing, **kw)
        return Measurement(phases, f"{what}; all {total} layers built", (total,), total)
    s1, c1 = reduced(spec, hf_config, d1)
    s2, c2 = reduced(spec, hf_config, d2)
    p1 = run_phases(s1, seq_len, micro_batch, checkpointing, **dict(kw, hf_config=c1))
    p2 = run_phases(s2, seq_len, micro_batch, checkpointing, **dict(kw, hf_config=c2))
    phases = p1.extrapolate(p2, d1, d2, total)
    return Measurement(phases, f"{what}; built at {d1} and {d2} layers and extrapolated per layer to {total}",
                       (d1, d2), total)
