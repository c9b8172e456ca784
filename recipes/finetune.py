"""Fine-tune a checkpoint you downloaded: LoRA (default), QLoRA or in full, sized by the planner.

transformers' own class of the checkpoint's family (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE);
PEFT's LoRA on a frozen base (QLoRA: bitsandbytes NF4); chat (`messages`) or `prompt`/`completion` rows with the
loss on the answers only; RUN/adapter/ (PEFT) and RUN/hf/ (the merged model) at the end.

    accelerate launch --use_deepspeed recipes/finetune.py --init-from Meta-Llama-3-8B --dataset chat.jsonl
    accelerate launch --use_deepspeed recipes/finetune.py --init-from Meta-Llama-3-8B --finetune qlora --dataset chat.jsonl
    python recipes/finetune.py --init-from Meta-Llama-3-8B --dataset chat.jsonl --dry-run --gpu rtx4090

Flags: `python recipes/finetune.py --help` and docs/finetune.md (README.md's "Fine-tune a model you downloaded" in short).
"""

from adaptive.recipe import Recipe

recipe = Recipe(finetune="lora")

if __name__ == "__main__":
    raise SystemExit(recipe.main())
