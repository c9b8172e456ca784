"""A fine-tune's defaults: its global batch, learning rate and length, each from a published recipe.

A fine-tune is not a pretraining run: its batch and learning rate are the recipes' (DeepSeek LLM's compute-optimal
laws describe training from scratch), and its length is the dataset's tokens times the epochs, not 20 tokens per
parameter.
"""

from __future__ import annotations

from adaptive.plan.finetune.method import Finetune
from adaptive.record import record


@record
class Recipe:
    """The global batch (in sequences) and the peak learning rate of a published fine-tuning recipe."""

    sequences: int
    lr: float
    source: str


FULL = Recipe(128, 2e-5, "Stanford Alpaca (tatsu-lab/stanford_alpaca README, 'Fine-tuning'): batch size 128, "
                         "learning rate 2e-5, 3 epochs, max length 512")
ADAPTER = Recipe(16, 2e-4, "QLoRA (artidoro/qlora, qlora.py TrainingArguments defaults): 1 sequence x 16 accumulation "
                           "steps, learning rate 2e-4, for LoRA and QLoRA alike")
DEFAULT_DATASET_TOKENS = 10e6  # about Alpaca's 52K examples at 200 tokens each: a typical instruction set
DEFAULT_EPOCHS = 1.0


def recipe(finetune: Finetune) -> Recipe:
    return ADAPTER if finetune.adapted else FULL


def global_batch_tokens(finetune: Finetune, seq_len: int) -> int:
    return recipe(finetune).sequences * seq_len


__all__ = ["ADAPTER", "DEFAULT_DATASET_TOKENS", "DEFAULT_EPOCHS", "FULL", "Recipe", "global_batch_tokens", "recipe"]
