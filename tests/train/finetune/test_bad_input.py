"""A fine-tune's bad input is one line on stderr, exit code 2, and nothing written: the run folder is not created.

Each case runs `python recipes/finetune.py` as a user does, and the data's cases `adaptive launch` too (which checks
them before it writes the run's configs). The data and tokenizer checks run before the run folder is claimed
(adaptive/train/run/entry.py check_data); the others fail while parsing or planning.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.train._launch import REPO, launch_env
from tests.train.finetune._checkpoints import write_checkpoint
from tests.train.finetune._run import RECIPE


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_llama, chat_jsonl):
    root = tmp_path_factory.mktemp("bad-input")
    rows = [json.loads(line) for line in chat_jsonl.read_text().splitlines()[:6]]
    rows[3] = {"conversation": rows[3]["messages"]}  # ShareGPT's name for the field
    no_messages = root / "no_messages.jsonl"
    no_messages.write_text("".join(json.dumps(r) + "\n" for r in rows))
    no_layout = root / "no_layout.jsonl"  # every row ShareGPT-like: none of text, messages, prompt/completion
    no_layout.write_text("".join(json.dumps({"conversation": r.get("messages", r.get("conversation"))}) + "\n"
                                 for r in rows))
    no_tokenizer = write_checkpoint(root / "no-tokenizer", "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    return {"llama": tiny_llama, "chat": chat_jsonl, "no_messages": no_messages, "no_layout": no_layout,
            "root": root, "no_tokenizer": no_tokenizer,
            "no_template": write_checkpoint(root / "no-template", "llama", chat_template=False),
            "gpt2": write_checkpoint(root / "tiny-gpt2", "gpt2")}


CASES = {
    "a chat row without messages": (["--init-from", "{llama}", "--dataset", "{no_messages}"],
                                    "error: {no_messages}:4 has no 'messages' field (fields: conversation)"),
    "chats and a tokenizer without a chat template": (
        ["--init-from", "{no_template}", "--dataset", "{chat}"],
        "error: '{chat}' holds chats (messages), and the tokenizer has no chat template"),
    "a LoRA target that matches no module": (
        ["--init-from", "{llama}", "--dataset", "{chat}", "--lora-targets", "nope"],
        "error: --lora-targets 'nope' matches no linear layer of this llama model"),
    "--finetune lora without --init-from": (["--finetune", "lora", "--dataset", "{chat}"],
                                            "error: --finetune lora fine-tunes a checkpoint: give --init-from PATH"),
    "an unsupported model_type": (["--init-from", "{gpt2}", "--dataset", "{chat}"],
                                  "error: --init-from '{gpt2}': unsupported model_type 'gpt2'"),
    "rows of no layout a run reads": (["--init-from", "{llama}", "--dataset", "{no_layout}"],
                                      "error: {no_layout}:1 has no 'text' field (fields: conversation); a row needs "
                                      "'text' (documents), 'messages' (chats) or 'prompt' and 'completion'"),
    "a checkpoint without its tokenizer": (["--init-from", "{no_tokenizer}", "--dataset", "{chat}"],
                                           "error: --init-from '{no_tokenizer}' holds no tokenizer"),
}
# what only the data and the tokenizer reveal: `adaptive launch` checks it too, before it writes the run's configs
DATA_CASES = ("a chat row without messages", "chats and a tokenizer without a chat template",
              "rows of no layout a run reads", "a checkpoint without its tokenizer")


def check_refused(inputs, case: str, folder: str, *command: str, stdout_empty: bool = False) -> None:
    """`command` with the case's flags: one line on stderr naming the bad input, exit 2, no run folder."""
    flags, expected = CASES[case]
    out = inputs["root"] / f"{folder}-{list(CASES).index(case)}"
    home = inputs["root"] / "home"
    home.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, *command, *(f.format(**inputs) for f in flags), "--seq-len", "64",
                           "--output-dir", str(out)], cwd=REPO, env=launch_env(home), capture_output=True, text=True,
                          timeout=120)
    lines = done.stderr.strip().splitlines()
    assert (done.returncode, len(lines)) == (2, 1), done.stdout + done.stderr
    assert not (stdout_empty and done.stdout), done.stdout  # launch prints no plan before the refusal
    assert lines[0].startswith(expected.format(**inputs)), lines[0]
    assert not out.exists()


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, inputs):
    check_refused(inputs, case, "run", str(RECIPE))


@pytest.mark.parametrize("case", DATA_CASES)
def test_adaptive_launch_refuses_bad_data_before_writing_its_configs(case, inputs):
    check_refused(inputs, case, "launch", "-m", "cli", "launch", str(RECIPE), stdout_empty=True)
