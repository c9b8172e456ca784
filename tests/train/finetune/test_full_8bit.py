"""A full fine-tune with `--optimizer adamw_8bit`: bitsandbytes' AdamW8bit is the optimizer DeepSpeed's engine steps
(a client optimizer: alone under ZeRO-0, inside DeepSpeed's ZeRO optimizer under ZeRO-2), its moments are uint8,
and the loss falls. The probes' loss is on the answers of three examples, before the first step and after the last.
"""

from __future__ import annotations

import pytest

from tests.train._launch import tail
from tests.train.finetune._run import FLAGS, finetune, losses, recorded

ADAMW_8BIT = "bitsandbytes.optim.adamw.AdamW8bit"


@pytest.mark.parametrize("zero", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_adamw_8bit_trains_a_full_fine_tune_with_uint8_moments(zero, tmp_path, tiny_llama, chat_jsonl):
    from transformers import AutoModelForCausalLM

    record = tmp_path / "record"
    flags = [*FLAGS, "--init-from", str(tiny_llama), "--dataset", str(chat_jsonl), "--finetune", "full",
             "--optimizer", "adamw_8bit", "--lr", "1e-3", "--zero", str(zero)]
    done = finetune(tmp_path / "run", flags, {"record": str(record)})
    assert done.returncode == 0, tail(done)
    got = recorded(record)
    train = losses(tmp_path / "run")
    steps = sorted(train)
    first, last = (sum(train[s] for s in part) / len(part) for part in (steps[:4], steps[-4:]))
    print(f"ZeRO-{zero}: train loss {first:.3f} -> {last:.3f}; optimizer {got['optimizer']}, states "
          f"{got['state_dtypes']}")
    assert last < first - 0.5  # measured: 7.43 -> 6.48 (mean of the first and last 4 steps)
    assert got["optimizer"][-1] == ADAMW_8BIT
    assert got["optimizer"][0] == (ADAMW_8BIT if zero == 0 else
                                   "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer")
    # 8-bit moments (state1, state2) for tensors of 4096 values or more; bitsandbytes keeps smaller ones in fp32.
    # ZeRO-0 steps the 12 large matrices one by one (embedding, head, q/o/gate/up/down of 2 layers); ZeRO-2 steps
    # one flat partition per parameter group, the decayed matrices' in 8 bits
    assert got["state_dtypes"].get("torch.uint8") == (24 if zero == 0 else 2), got["state_dtypes"]
    assert got["frozen"] == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")  # transformers' own class, as trained
    assert type(exported).__name__ == "LlamaForCausalLM"
