"""What each parameter is during a run: trained (16-bit weight, gradient, optimizer state) or frozen (held only, in
16 bits or as NF4 blocks). Full fine-tuning, LoRA and QLoRA are three splits of one model's parameters; the memory
and speed models do the same arithmetic over any split (estimate/memory.py, estimate/op_times.py).

Counted, not estimated: the adapters are PEFT's (A: rank x in, B: out x rank per targeted linear, no bias; per expert on
a 3D expert parameter), the
NF4 storage is bitsandbytes 0.50's as transformers 5 loads it (tests/fidelity/test_finetune_states.py builds both
and compares every byte).
"""

from __future__ import annotations

import math
from functools import lru_cache

from adaptive.plan.architecture.families import linear_modules, resolve_targets
from adaptive.plan.architecture.params import count_params
from adaptive.plan.architecture.presets import ModelSpec
from adaptive.plan.finetune.method import Finetune
from adaptive.record import record

# bitsandbytes' NF4 with double quantisation, as transformers' BitsAndBytesConfig(load_in_4bit=True,
# bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True) stores a linear's weight (bitsandbytes/functional.py
# quantize_4bit, QuantState): two 4-bit codes a byte; per block of 64 weights one absmax, itself quantized to a byte;
# per 256 of those a float32 absmax; and per linear a 16-entry NF4 code, a 256-entry float32 code for the absmaxes
# and a float32 offset. The bias, where there is one, stays 16-bit.
NF4_BLOCK = 64
NESTED_BLOCK = 256
NF4_LINEAR_CONSTANT_BYTES = 16 * 4 + 256 * 4 + 4


def nf4_packed_bytes(weights: int) -> int:
    """The packed 4-bit codes of one weight (a parameter: ZeRO-3 partitions it when stored in a 16-bit dtype)."""
    return math.ceil(weights / 2)


def nf4_state_bytes(weights: int) -> int:
    """One weight's quantization state (not a parameter; every GPU holds it whole)."""
    blocks = math.ceil(weights / NF4_BLOCK)
    return blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + NF4_LINEAR_CONSTANT_BYTES


def dequantized_bytes(weights: int, bytes_per_value: int = 2) -> int:
    """A 4-bit weight dequantized for one matmul: its 16-bit copy and the float32 absmaxes of its blocks
    (bitsandbytes' default gemm_4bit: dequantize_blockwise of the absmaxes, then dequantize_4bit, then linear)."""
    return bytes_per_value * weights + 4 * math.ceil(weights / NF4_BLOCK)


@record
class ParamRoles:
    """A model's parameters split by role. Pretraining and full fine-tuning train all of them."""

    trainable: int  # parameters with a gradient and optimizer states: 16-bit weights (adapters under LoRA)
    trainable_expert: int  # of them, inside routed experts (split over expert-parallel ranks)
    frozen_16bit: int  # frozen, held in 16 bits
    frozen_4bit: int  # frozen linear weights held as NF4
    nf4_packed_bytes: int  # their packed codes (parameters)
    nf4_state_bytes: int  # their absmaxes and codes (quantization state, not parameters)
    largest_4bit_linear: int  # weights of the largest NF4 linear: the transient its dequantized copy needs
    adapter: int = 0  # LoRA parameters (A and B of every target); all of them trainable

    @property
    def frozen(self) -> int:
        return self.frozen_16bit + self.frozen_4bit

    @property
    def frozen_bytes(self) -> int:
        """What the frozen base holds on one GPU that holds all of it."""
        return 2 * self.frozen_16bit + self.nf4_packed_bytes + self.nf4_state_bytes

    @property
    def total(self) -> int:
        return self.trainable + self.frozen


def trains_everything(finetune: Finetune | None) -> bool:
    return finetune is None or not finetune.adapted


@lru_cache(maxsize=256)
def param_roles(spec: ModelSpec, finetune: Finetune | None = None) -> ParamRoles:
    """The split `finetune` makes of `spec`'s parameters (None: pretraining, every parameter trained)."""
    c = count_params(spec)
    if trains_everything(finetune):
        return ParamRoles(trainable=c.total, trainable_expert=c.expert, frozen_16bit=0, frozen_4bit=0,
                          nf4_packed_bytes=0, nf4_state_bytes=0, largest_4bit_linear=0)
    assert finetune is not None
    adapter = sum(m.adapter_params(finetune.lora_rank) for m in resolve_targets(spec, finetune.lora_targets))
    quantized = [m for m in linear_modules(spec) if m.role != "head"] if finetune.quantized else []
    four_bit = sum(m.count * m.weight_params for m in quantized)
    return ParamRoles(
        trainable=adapter, trainable_expert=0, frozen_16bit=c.total - four_bit, frozen_4bit=four_bit,
        nf4_packed_bytes=sum(m.count * nf4_packed_bytes(m.weight_params) for m in quantized),
        nf4_state_bytes=sum(m.count * nf4_state_bytes(m.weight_params) for m in quantized),
        largest_4bit_linear=max((m.weight_params for m in quantized), default=0), adapter=adapter)


__all__ = ["NF4_BLOCK", "ParamRoles", "dequantized_bytes", "nf4_packed_bytes", "nf4_state_bytes", "param_roles",
           "trains_everything"]
