"""The same policies inside a transformers Trainer (CPU, tiny skewed MoE, 20 steps of 2 x 4 samples): the
forward hook feeds every micro-batch's router stats once, the bias is updated after every optimizer step,
events.jsonl lands in the Trainer's output_dir, and requests the Trainer cannot honour are warned about."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from adaptive.orchestrator import OrchestratorConfig, policies
from adaptive.train.run.callbacks import Callback
from tests.orchestrator._harness import fixed_data, skewed_moe

pytestmark = pytest.mark.slow  # a transformers Trainer run

STEPS = 20


class AskToSkip(Callback):
    def on_backward_end(self, state, control, *, outputs, loss, batch):
        if state.step == 2:
            control.skip_step = True


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from transformers import Trainer, TrainingArguments

    from adaptive.train.hf_trainer import OrchestratorCallback

    environ = dict(os.environ)  # accelerate's state (the Trainer's) sets OMP_NUM_THREADS and friends
    out = tmp_path_factory.mktemp("trainer")
    model = skewed_moe()
    rows = fixed_data(1, batches=4).reshape(-1, 32)  # 32 sequences of 32 tokens
    data = [{"input_ids": r, "labels": r} for r in rows]
    callbacks = policies(OrchestratorConfig(policies=("balance",), settings={"balance": {"rate": 0.01}}))
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=STEPS, logging_steps=5, save_strategy="no", report_to=[], use_cpu=True,
                             learning_rate=3e-3, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    adapter = OrchestratorCallback([AskToSkip(), *callbacks])
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[adapter])
    logger = logging.getLogger("adaptive.train.hf_trainer")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        trainer.train()
    finally:
        logger.removeHandler(handler)
    yield out, model, callbacks, records
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # later in-process tests build their own
    os.environ.clear()
    os.environ.update(environ)


def test_every_micro_batch_reaches_the_monitor_once(trained):
    _, _, callbacks, _ = trained
    monitor = callbacks[0]
    assert [s.step for s in monitor.history] == [5, 10, 15, 20]  # the Trainer's logging steps
    for summary in monitor.history:
        # 5 steps x 2 micro-batches x 4 sequences x 32 tokens, two routes each (top-2)
        assert [sum(layer) for layer in summary.expert_counts] == [5 * 2 * 4 * 32 * 2] * 2
        assert summary.micro_batches == 10 and summary.loss is not None


def test_the_bias_is_updated_after_every_optimizer_step(trained):
    _, model, callbacks, _ = trained
    balance = callbacks[1]
    assert balance.updates == STEPS
    for gate in model.moe_gates():
        bias = gate.e_score_correction_bias
        assert bias[0] < 0 and bias[1] < 0, "the favoured experts were pushed down"
        assert torch.all(bias.abs() <= STEPS * 0.01 + 1e-6)


def test_events_are_written_to_the_trainers_output_dir(trained):
    out, _, _, _ = trained
    records = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [(r["step"], r["action"]) for r in records if r["kind"] == "decision"] == [
        (5, "bias_update"), (10, "bias_update"), (15, "bias_update"), (20, "bias_update")]
    assert records[-1]["kind"] == "summary" and records[-1]["balance"]["updates"] == STEPS


def test_requests_the_trainer_cannot_honour_are_warned_about(trained):
    _, _, _, records = trained
    messages = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(messages) == 1 and "cannot honour skip_step" in messages[0]
