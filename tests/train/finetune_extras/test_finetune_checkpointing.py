"""Checkpointing policies on a fine-tune's model, as the OOM ladder changes them mid-run: transformers' own class
under PEFT's LoRA wrapper takes off, every:N and full (through the wrapper), refuses "mlp" in one line (our decoder
layer's alone), and the ladder passes over "mlp" for a plan of transformers' class, as the planner does."""

from __future__ import annotations

import pytest
import torch

from adaptive.errors import AdaptiveError
from adaptive.models.checkpointing import apply_checkpointing, checkpointing_policy
from adaptive.train.run.callbacks import Knobs
from adaptive.orchestrator.oom import OOMConfig, next_rung, unsupported_policies


def llama(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8))


def lora(model):
    from peft import LoraConfig, get_peft_model

    model.requires_grad_(False)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                            init_lora_weights=False))


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("wrap", [lora, lambda m: m], ids=["lora", "full"])
def test_each_policy_the_ladder_sets_runs_on_transformers_class_under_peft_too(wrap):
    model = wrap(llama())
    model.train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    assert checkpointing_policy(model) == "off"
    reference = loss_and_grads(model, ids)
    for policy in ("every:4", "every:2", "full", "off"):
        apply_checkpointing(model, policy)
        assert checkpointing_policy(model) == policy
        loss, grads = loss_and_grads(model, ids)  # recomputed layers give the same loss and gradients
        assert loss == pytest.approx(reference[0], abs=1e-6)
        assert grads.keys() == reference[1].keys()
        assert all(torch.allclose(grads[n], reference[1][n], atol=1e-6) for n in grads), policy


def test_mlp_checkpointing_is_refused_on_transformers_class_in_one_line():
    model = lora(llama())
    with pytest.raises(AdaptiveError) as err:
        apply_checkpointing(model, "mlp")
    assert "needs adaptive's model class" in str(err.value) and "\n" not in str(err.value)
    assert checkpointing_policy(model) == "off"  # nothing changed


def test_the_oom_ladder_passes_over_mlp_for_a_fine_tunes_plan_and_keeps_it_for_ours():
    from adaptive.plan import fit, make_request

    finetune = fit(make_request(model="debug", gpu="h100", finetune="full", kernels="plain"))  # transformers' class
    ours = fit(make_request(model="debug", gpu="h100", kernels="lean"))
    assert unsupported_policies(finetune) == {"mlp"}
    assert unsupported_policies(ours) == frozenset() and unsupported_policies(None) == frozenset()
    config = OOMConfig()
    knobs = Knobs(micro_batch_size=1, gradient_accumulation_steps=4, seq_len=64, gradient_checkpointing=False,
                  zero_stage=0, offload_optimizer=False, offload_params=False, ep_size=1)
    for skip, expected in ((unsupported_policies(finetune), ["every:4", "every:2", "full"]),
                           (unsupported_policies(ours), ["every:4", "every:2", "mlp", "full"])):
        seen, current = [], knobs
        while (rung := next_rung(current, config, skip)) is not None:
            seen.append(rung[1]["checkpoint_policy"])
            current = current.changed(rung[1])
        assert seen == expected


def test_a_fine_tunes_ladder_ends_at_full_checkpointing_without_cutting_its_examples():
    """Cutting an instruction block into pieces leaves answers without their prompts: the ladder stops at full
    checkpointing for a fine-tune."""
    from adaptive.orchestrator.events import EventLog
    from adaptive.orchestrator.oom import OOMPolicy, shorter_seq_blocked
    from adaptive.plan import fit, make_request
    from adaptive.train.run.callbacks import Control, TrainerState

    finetune = fit(make_request(model="debug", gpu="h100", finetune="full", kernels="plain"))
    pretraining = fit(make_request(model="debug", gpu="h100", kernels="lean"))
    assert shorter_seq_blocked(finetune) and shorter_seq_blocked(pretraining) is None
    knobs = Knobs(micro_batch_size=1, gradient_accumulation_steps=4, seq_len=64, gradient_checkpointing=True,
                  zero_stage=0, offload_optimizer=False, offload_params=False, ep_size=1, checkpoint_policy="full")
    for plan, action in ((pretraining, "halve_seq_len"), (finetune, "exhausted")):
        policy, control = OOMPolicy(EventLog(), OOMConfig(min_seq_len=32)), Control()
        policy.on_oom(TrainerState(max_steps=10, knobs=knobs, output_dir=None, step=3, plan=plan), control,
                      error=torch.OutOfMemoryError())
        assert policy.events.decisions[-1]["action"] == action and control.retry_step == (action != "exhausted")
    assert "no shorter sequence for a fine-tune" in policy.events.decisions[-1]["reason"]
