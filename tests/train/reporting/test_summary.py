"""The words a run prints about itself: the plan's knobs in one phrase, the end-of-run block."""

from __future__ import annotations

import pytest

from adaptive.train.reporting.summary import LaunchTotals, duration, generate_command, knobs_line, summary_lines

KNOBS = {"micro_batch_size": 4, "gradient_accumulation_steps": 1, "seq_len": 128, "gradient_checkpointing": False,
         "zero_stage": 0, "offload_optimizer": False, "offload_params": False, "ep_size": 1, "block_len": 128,
         "sp_size": 1, "tp_size": 1, "pp_size": 1, "checkpoint_policy": "off"}


def test_the_knobs_read_as_a_phrase():
    assert knobs_line(KNOBS) == "mb 4 x accum 1, seq 128, ZeRO 0, no offload, checkpointing off"
    other = {**KNOBS, "gradient_accumulation_steps": 8, "zero_stage": 3, "offload_optimizer": True, "seq_len": 64,
             "offload_params": True, "ep_size": 4, "pp_size": 2, "checkpoint_policy": "every:2"}
    assert knobs_line(other) == ("mb 4 x accum 8, seq 64 (blocks of 128 cut into pieces), ZeRO 3, "
                                 "offload optimizer + params, checkpointing every:2, EP 4, PP 2")


def test_the_launch_mean_leaves_out_the_first_step_only_when_there_are_others():
    totals = LaunchTotals(first_step=10)
    totals.add(2.0, 512)  # the warm-up step
    assert totals.tokens_per_s() == 256.0
    totals.add(0.5, 512)
    totals.add(0.5, 512)
    assert totals.tokens_per_s() == 1024.0 and totals.warmup_seconds == 2.0 and totals.seconds == 3.0


@pytest.mark.parametrize("seconds, shown", [(12.34, "12.3 s"), (245, "4m 05s"), (7380, "2h 03m"), (None, "-")])
def test_durations(seconds, shown):
    assert duration(seconds) == shown


END = {"step": 40, "wall_seconds": 75.0, "train_seconds": 50.0, "train_steps": 20, "warmup_seconds": 3.0,
       "train_seconds_total": 98.0, "tokens_per_s": 2048.0, "mfu": 0.412, "tokens_seen": 81920, "loss": 2.5,
       "loss_steps": 5, "eval_loss": 2.25, "eval_ppl": 9.4877, "peak_memory_bytes": 3 * 2**30,
       "peak_memory_kind": "cuda_allocated", "peak_rss_bytes": 2**30, "device": "cuda", "launches": 2,
       "first_step": 20, "run_dir": "runs/ft", "checkpoint": "runs/ft/checkpoints/step_00000040",
       "export": "runs/ft/hf", "adapter": "runs/ft/adapter", "finetune": "lora"}


def test_a_resumed_fine_tunes_summary_names_its_launch_adapter_and_chat_command():
    text = "\n".join(summary_lines(END))
    for part in ("wall time   1m 15s (this launch; resumed at step 20), of which training steps 50.0 s, "
                 "all launches' steps 1m 38s",
                 "steps       40 (81,920 tokens)", "train 2.5000 (mean of the last 5 steps), eval 2.2500 (ppl 9.49)",
                 "2,048 tokens/s (first step's warm-up, 3.0 s, left out), MFU 41.2%",
                 "3.00 GiB GPU peak allocated, host peak RSS 1.00 GiB", "adapter     runs/ft/adapter",
                 "adaptive report runs/ft", "'content': 'Hello!'", "[-1]['content']"):
        assert part in text, text
    assert "adaptive export" not in text  # transformers' own class: nothing to rewrite


def test_a_cpu_pretraining_summary_says_why_there_is_no_mfu_and_offers_report_and_generate():
    end = {**END, "launches": 1, "device": "cpu", "mfu": None, "peak_memory_kind": "cpu_rss", "adapter": None,
           "finetune": None, "export": "runs/a b/hf", "run_dir": "runs/a b"}
    text = "\n".join(summary_lines(end))
    assert "resumed" not in text and "MFU n/a (no peak FLOP/s for a CPU)" in text
    assert "3.00 GiB process peak RSS" in text and "host peak RSS" not in text
    assert "adaptive report 'runs/a b'" in text
    assert "adaptive export" not in text  # a Llama export: `adaptive export` would have nothing to do
    assert generate_command("runs/a b/hf") in text
    assert generate_command("runs/x/hf") == ("python -c \"from transformers import pipeline; g = pipeline("
                                             "'text-generation', model='runs/x/hf'); print(g('The devil is', "
                                             "max_new_tokens=20)[0]['generated_text'])\"")
    # a MoD or hybrid export carries its modeling code: transformers runs it only when trusted
    assert "model='runs/x/hf', trust_remote_code=True)" in generate_command("runs/x/hf", remote_code=True)
    remote = "\n".join(summary_lines({**end, "export_remote_code": True}))
    assert "trust_remote_code" in remote and "adaptive export 'runs/a b'" in remote  # it says why no portable format


def test_in_a_terminal_the_block_keeps_a_long_command_on_one_line(monkeypatch, tmp_path):
    import io
    import logging

    from rich.console import Console

    from adaptive.train.reporting import display

    screen = io.StringIO()
    monkeypatch.setattr(display, "_console", Console(file=screen, force_terminal=True, width=60))
    lines = summary_lines({**END, "export": f"{tmp_path}/[bold]hf"})
    display.show_block(logging.getLogger("test"), "run finished", lines)
    shown = screen.getvalue().splitlines()
    assert shown[0] == "run finished" and [line[2:] for line in shown[1:]] == lines  # a line each, none wrapped
    assert max(map(len, lines)) > 60 and "[bold]hf" in screen.getvalue()  # longer than the screen; no markup read
