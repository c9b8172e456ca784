"""A fine-tune's bad input is one line on stderr, exit code 2, and nothing written: the run folder is not created.

Each case runs `python recipes/finetune.py` as a user does. The chat-template check runs before the run folder is
claimed (adaptive/train/run/entry.py); the others fail while parsing or planning.
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
    return {"llama": tiny_llama, "chat": chat_jsonl, "no_messages": no_messages, "root": root,
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
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, inputs):
    flags, expected = CASES[case]
    out = inputs["root"] / f"run-{list(CASES).index(case)}"
    home = inputs["root"] / "home"
    home.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, str(RECIPE), *(f.format(**inputs) for f in flags), "--seq-len", "64",
                           "--output-dir", str(out)], cwd=REPO, env=launch_env(home), capture_output=True, text=True,
                          timeout=120)
    lines = done.stderr.strip().splitlines()
    assert (done.returncode, len(lines)) == (2, 1), done.stdout + done.stderr
    assert lines[0].startswith(expected.format(**inputs)), lines[0]
    assert not out.exists()
