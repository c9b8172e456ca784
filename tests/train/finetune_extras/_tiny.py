"""A tiny downloaded-looking checkpoint and chat data for the fine-tune tests of this folder (no hub):

    python tests/train/finetune_extras/_tiny.py OUT_DIR [HIDDEN]

transformers' LlamaForCausalLM (2 layers, 4 heads, 2 KV heads; hidden 64 unless told), seeded, saved with
save_pretrained, with the built-in offline BPE (vocab 2048) and a chat template whose `{% generation %}` blocks
mark the assistant turns; 64 chat rows of "what is a plus b" sums, which a LoRA learns within an epoch.
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
ROWS = 64


def write_llama(folder: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A Llama of `hidden` (intermediate 2.5x, head_dim hidden/4) in fp32 with the offline tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from adaptive.train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 5 // 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden // 4, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def write_chat(path: Path, rows: int = ROWS) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            a, b = i % 7, i % 5
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                             {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}) + "\n")
    return Path(path)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    write_llama(out / "tiny-llama", int(sys.argv[2]) if len(sys.argv) > 2 else 64)
    write_chat(out / "chat.jsonl")
