"""Tiny downloaded-looking checkpoints and instruction data for the fine-tune tests (no hub):

    python tests/train/finetune/_checkpoints.py OUT_DIR      # writes what the conftest's fixtures write

A checkpoint is transformers' own class of its family (hidden 64, 2 layers, 4 heads, 2 KV heads), seeded, saved with
save_pretrained, with the built-in offline BPE as its tokenizer and a small chat template whose `{% generation %}`
blocks mark the assistant turns. The data are 64 rows of "what is a plus b" sums: a pattern a LoRA of rank 8 learns
within an epoch, so the loss falls clearly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] + eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
SHAPE = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, tie_word_embeddings=False)
ROWS = 64


def write_checkpoint(folder: Path, model_type: str, *, dtype: str = "float32", chat_template: bool = True,
                     seed: int = 0, **shape: int) -> Path:
    """`model_type`'s class at the tiny shape (`shape` overriding its fields), saved in `dtype` with the offline
    tokenizer (and the chat template)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from adaptive.train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = CHAT_TEMPLATE if chat_template else None
    shape = {**SHAPE, **shape}
    if model_type == "gpt2":  # an unsupported family: its own names for the shape
        shape = dict(n_embd=64, n_layer=2, n_head=4)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def write_llama(folder: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A Llama of `hidden` (intermediate 2.5x, 4 heads) and `layers` in fp32: the NVMe and orchestrator tests' sizes."""
    return write_checkpoint(folder, "llama", seed=seed, hidden_size=hidden, intermediate_size=hidden * 5 // 2,
                            head_dim=hidden // 4, num_hidden_layers=layers)


def sums(i: int) -> tuple[int, int]:
    return i % 7, i % 5


def write_chat(path: Path, rows: int = ROWS) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            a, b = sums(i)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                             {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}) + "\n")
    return Path(path)


def write_prompt_completion(path: Path, rows: int = ROWS) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            a, b = sums(i)
            f.write(json.dumps({"prompt": f"Q: {a} plus {b}?\nA:", "completion": f" {a + b}"}) + "\n")
    return Path(path)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out / "tiny-llama", "llama")
    write_checkpoint(out / "tiny-qwen3", "qwen3", dtype="bfloat16")
    write_chat(out / "chat.jsonl")
    write_prompt_completion(out / "prompt_completion.jsonl")
