"""The orchestrator's callback API on the real loop: the events fire in the documented order, and the
requests a policy can make work: skip a step (its gradients discarded on ZeRO-2 and on ZeRO-0), redo a step
after an OOM with half the micro-batch and twice the accumulation on the same samples, roll back to the last
checkpoint, scale the LR, with the knobs in force written back to the run's plan files."""

from __future__ import annotations

import json

import pytest
import torch

from adaptive.errors import AdaptiveError
from adaptive.train.run.callbacks import Callback, CallbackList, Control, Knobs, TrainerState
from tests.train._launch import driver, records, tail

RUN = ["--max-steps", "12", "--log-every", "1", "--checkpoint-every", "4", "--eval-every", "6", "--seq-len", "64",
       "--micro-batch", "4", "--grad-accum", "2", "--zero", "2", "--no-progress"]
SPEC = {"skip_at": 3, "oom_at": 5, "halve_on_oom": True, "rollback_at": 7, "lr_scale_at": [8, 0.5],
        "touch_at": {"2": "EXPORT"}}


# --- the API itself ----------------------------------------------------------------------------


def knobs(**kw) -> Knobs:
    base = dict(micro_batch_size=4, gradient_accumulation_steps=2, seq_len=64, gradient_checkpointing=False,
                zero_stage=2, offload_optimizer=False, offload_params=False, ep_size=1)
    return Knobs(**{**base, **kw})


def test_callback_list_calls_every_callback_in_order_with_state_and_control():
    seen = []

    class Named(Callback):
        def __init__(self, name):
            self.name = name

        def on_step_start(self, state, control):
            seen.append((self.name, state.step))
            control.skip_step = True

        def on_step_end(self, state, control, *, metrics):
            seen.append((self.name, metrics["loss"]))

    chain = CallbackList([Named("a"), Named("b"), Callback()])
    state = TrainerState(max_steps=3, knobs=knobs(), output_dir=None, step=2)
    control = Control()
    chain.on_step_start(state, control)
    chain.on_step_end(state, control, metrics={"loss": 1.5})
    chain.on_train_end(state, control)  # the no-op base answers every event
    assert seen == [("a", 2), ("b", 2), ("a", 1.5), ("b", 1.5)] and control.skip_step


def test_only_runtime_knobs_change_and_values_are_checked():
    k = knobs()
    assert k.changed({"micro_batch_size": 2, "gradient_accumulation_steps": 4}).samples_per_step == k.samples_per_step
    with pytest.raises(AdaptiveError, match="knob 'zero_stage' cannot change while training"):
        k.changed({"zero_stage": 3})
    with pytest.raises(AdaptiveError, match="must be a positive integer"):
        k.changed({"micro_batch_size": 0})
    state = TrainerState(max_steps=1, knobs=k, output_dir=None, world_size=4)
    assert state.tokens_per_step == 4 * 2 * 64 * 4 and state.is_main_process


def test_seq_len_is_a_runtime_knob_that_cuts_blocks_into_consecutive_pieces():
    from adaptive.train.run.loop import cut_blocks

    k = knobs(micro_batch_size=1, gradient_accumulation_steps=8)
    short = k.changed({"seq_len": 16, "gradient_accumulation_steps": 32})
    assert (short.block_len, short.pieces_per_block, short.samples_per_step, short.sequences_per_step) == (64, 4, 8, 32)
    assert short.tokens_per_step == k.tokens_per_step == 8 * 64
    with pytest.raises(AdaptiveError, match="knob 'block_len' cannot change"):
        k.changed({"block_len": 32})
    blocks = torch.arange(3 * 64).reshape(3, 64)
    cut = cut_blocks({"input_ids": blocks, "labels": blocks.clone()}, short)
    assert cut["input_ids"].shape == (12, 16) and cut["input_ids"].data_ptr() == blocks.data_ptr(), "a view"
    assert cut["input_ids"][4:8].flatten().tolist() == blocks[1].tolist(), "block 1 = pieces 4-7, in order"
    assert cut_blocks({"input_ids": blocks}, k)["input_ids"] is blocks
    old = Knobs(**{kk: v for kk, v in k.as_dict().items() if kk != "block_len"})
    assert old.block_len == 64, "a checkpoint written before the field: its blocks were its seq_len"


@pytest.mark.parametrize("arch", ["dense", "moe", "mod", "hybrid"])
def test_every_architecture_trains_on_pieces_of_a_block(arch):
    from adaptive.train.run.loop import cut_blocks
    from tests.models._model_helpers import tiny_model

    model = tiny_model(arch)
    blocks = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    pieces = cut_blocks({"input_ids": blocks, "labels": blocks.clone()},
                        knobs(micro_batch_size=1, gradient_accumulation_steps=2).changed(
                            {"seq_len": 16, "gradient_accumulation_steps": 8}))
    out = model(**pieces)
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.logits is None  # training: the lean loss builds no logits
    stats = out.router_stats
    if arch in ("mod", "hybrid"):
        assert stats.mod_skip_rate is not None and torch.isfinite(stats.mod_skip_rate).all()
    if arch in ("moe", "hybrid"):
        assert int(stats.expert_counts.sum(-1)[0]) == 8 * 16 * model.config.num_experts_per_tok


def test_a_non_finite_loss_counts_as_a_skip_request():
    from adaptive.train.run.loop import agree_any

    class OneProcess:
        num_processes, device = 1, torch.device("cpu")

    state = TrainerState(max_steps=1, knobs=knobs(), output_dir=None, accelerator=OneProcess())
    assert agree_any(state, [False, True]) == [False, True]
    assert agree_any(state, [False], extra=~torch.isfinite(torch.tensor(float("nan")))) == [True]
    assert agree_any(state, [False], extra=~torch.isfinite(torch.tensor(2.0))) == [False]


# --- on the real loop ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    out = tmp_path_factory.mktemp("run")
    done = driver("debug", "dense", {**SPEC, "record": str(out / "events")}, [*RUN, "--output-dir", str(out)],
                  home=home, ADAPTIVE_CACHE=str(home / "cache"))
    assert done.returncode == 0, tail(done)
    events = json.loads((out / "events" / "events_rank0.json").read_text())
    return out, events


def _sequence(events) -> str:
    short = {"on_train_start": "T", "on_step_start": "S", "on_backward_end": "b", "on_oom": "M",
             "on_optimizer_step": "O", "on_step_end": "E", "on_eval": "V", "on_checkpoint": "C", "on_train_end": "Z"}
    return "".join(short[e["event"]] for e in events)


@pytest.mark.slow  # real recipe runs
def test_events_fire_in_the_documented_order(recorded):
    _, events = recorded
    two, four = "Sbb", "Sbbbb"
    oom = "SbbMbbbb"  # OOM after micro-batch 1, then the same step as 4 micro-batches of 2
    expected = ("T"
                + two + "OE" + two + "OE"  # steps 1, 2 (then the EXPORT request: an export, no event)
                + two + "E"  # step 3: skipped, no optimizer step
                + two + "OEC"  # step 4: checkpoint
                + oom + "OE" + four + "OEV" + four + "OE"  # steps 5, 6 (eval), 7 -> rollback to step 4
                + oom + "OE" + four + "OEV" + four + "OE"  # steps 5-7 again
                + four + "OEC" + (four + "OE") * 3  # step 8: checkpoint; 9-11
                + four + "OECV"  # step 12: the end's checkpoint and eval
                + "Z")
    assert _sequence(events) == expected
    assert events[0]["has"] == ["model", "optimizer", "scheduler", "accelerator", "plan"]
    assert all(e["router_stats"] is False for e in events if e["event"] == "on_backward_end")  # dense model
    assert [e["step"] for e in events if e["event"] == "on_checkpoint"] == [4, 8, 12]


def _step_ends(events):
    return [e for e in events if e["event"] == "on_step_end"]


@pytest.mark.slow  # real recipe runs
def test_skip_step_discards_the_gradients_and_the_schedule_moves_on(recorded):
    out, events = recorded
    ends = _step_ends(events)
    assert ends[1]["step"] == 2 and ends[2]["step"] == 3
    assert ends[2]["params_sum"] == ends[1]["params_sum"], "no update in the skipped step"
    assert ends[3]["params_sum"] != ends[2]["params_sum"], "the next step updates again"
    assert ends[2]["lr"] < ends[1]["lr"] and ends[2]["skipped"] == 1 and ends[1]["skipped"] == 0
    step3 = next(r for r in records(out, "train") if r["step"] == 3)
    assert step3["grad_norm"] is None and step3["skipped_steps"] == 1


@pytest.mark.slow  # real recipe runs
def test_oom_retry_redoes_the_same_step_on_the_same_samples_with_half_the_micro_batch(recorded):
    out, events = recorded
    step5 = [e for e in events if e["event"] == "on_backward_end" and e["step"] == 4][:6]
    first = [row for e in step5 if e["attempt"] == 0 for row in e["rows"]]
    retry = [row for e in step5 if e["attempt"] == 1 for row in e["rows"]]
    assert [len(e["rows"]) for e in step5] == [4, 4, 2, 2, 2, 2]
    assert retry == first and len(set(first)) == 8
    ends = _step_ends(events)
    assert ends[4]["step"] == 5 and ends[4]["samples_seen"] == 5 * 8, "no sample lost or repeated"
    assert (ends[4]["knobs"]["micro_batch_size"], ends[4]["knobs"]["gradient_accumulation_steps"]) == (2, 4)
    # the knobs in force are written back to the run's files
    plan, ds = (json.loads((out / name).read_text()) for name in ("plan.json", "ds_config.json"))
    assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"]) == (2, 4)
    assert plan["run"]["knobs"]["micro_batch_size"] == 2
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == \
        (2, 4, 8)


@pytest.mark.slow  # real recipe runs
def test_every_committed_step_ran_on_the_data_order_samples(recorded, tokenizer, datasets_cache):
    import hashlib

    from adaptive.train.data.batches import SampleIterator
    from adaptive.train.data.packing import build_datasets
    from adaptive.train.data.sources import DataConfig

    _, events = recorded
    train, _ = build_datasets(DataConfig(dataset=None, seq_len=64, seed=0, cache_dir=datasets_cache), tokenizer)
    batch = SampleIterator(train, 0).next_batch(12 * 8)["input_ids"]
    expected = [hashlib.sha1(r.numpy().tobytes()).hexdigest()[:12] for r in batch]
    rows_by_step: dict[int, list[str]] = {}
    current: list[str] = []
    for e in events:
        if e["event"] == "on_step_start":
            current = []
        elif e["event"] == "on_oom":
            current = []  # the failed try's micro-batches are redone
        elif e["event"] == "on_backward_end":
            current += e["rows"]
        elif e["event"] == "on_step_end":
            rows_by_step.setdefault(e["step"], []).append(current)
    assert sorted(rows_by_step) == list(range(1, 13))
    for step, runs in rows_by_step.items():
        for rows in runs:  # steps 5-7 ran twice (rollback): both times on their own samples
            assert rows == expected[(step - 1) * 8: step * 8], step


@pytest.mark.slow  # real recipe runs
def test_rollback_reloads_the_last_checkpoint_and_replays_identically(recorded):
    out, events = recorded
    ends = _step_ends(events)
    assert [e["step"] for e in ends] == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9, 10, 11, 12]
    restart = next(i for i, e in enumerate(events) if e["event"] == "on_step_start" and i > 0
                   and e["step"] < events[i - 1]["step"])
    assert events[restart]["step"] == 4 and events[restart]["samples_seen"] == 32
    first, again = ends[4:7], ends[7:10]
    assert [e["params_sum"] for e in first] == [e["params_sum"] for e in again]
    train = records(out, "train")
    losses = {}
    for r in train:
        losses.setdefault(r["step"], []).append(r["loss"])
    assert all(len(set(v)) == 1 for v in losses.values()) and len(losses[6]) == 2
    rollback = records(out, "rollback")
    assert len(rollback) == 1 and rollback[0]["from_step"] == 7 and rollback[0]["step"] == 4


@pytest.mark.slow  # real recipe runs
def test_lr_scale_multiplies_the_scheduled_lr_from_then_on(recorded):
    out, events = recorded
    ends = {e["step"]: e for e in _step_ends(events)}
    assert ends[7]["param_lr"] == pytest.approx(ends[7]["lr"])
    for step in (9, 10, 11):
        assert ends[step]["param_lr"] == pytest.approx(0.5 * ends[step]["lr"]) and ends[step]["lr"] > 0
    assert next(r for r in records(out, "train") if r["step"] == 9)["lr"] == pytest.approx(ends[9]["param_lr"])


@pytest.mark.slow  # real recipe runs
def test_an_export_file_exports_the_model_after_that_step(recorded):
    out, _ = recorded
    assert (out / "hf-step_00000002" / "model.safetensors").is_file()
    assert json.loads((out / "hf-step_00000002" / "adaptive_export.json").read_text())["step"] == 2
    assert not (out / "EXPORT").exists(), "the request file is consumed"


@pytest.mark.slow  # real recipe runs
def test_skip_step_on_zero_0_clears_the_gradients_and_a_stop_file_checkpoints_and_stops(tmp_path):
    out = tmp_path / "run"
    done = driver("debug", "dense", {"skip_at": 2, "touch_at": {"3": "STOP"}, "record": str(out / "events")},
                  ["--max-steps", "6", "--log-every", "1", "--seq-len", "64", "--micro-batch", "2", "--grad-accum",
                   "2", "--zero", "0", "--no-progress", "--output-dir", str(out)],
                  home=tmp_path, ADAPTIVE_CACHE=str(tmp_path / "cache"))
    assert done.returncode == 0, tail(done)
    ends = _step_ends(json.loads((out / "events" / "events_rank0.json").read_text()))
    assert ends[1]["params_sum"] == ends[0]["params_sum"] != ends[2]["params_sum"]
    assert [r["skipped_steps"] for r in records(out, "train")] == [0, 1, 1]
    assert all(r["loss"] == r["loss"] for r in records(out, "train")), "no NaN left behind"
    # STOP after step 3: a checkpoint to resume from, no final export, the request consumed
    assert [e["step"] for e in ends] == [1, 2, 3] and (out / "checkpoints" / "latest").read_text() == "step_00000003\n"
    assert not (out / "hf").exists() and not (out / "STOP").exists() and not records(out, "end")
