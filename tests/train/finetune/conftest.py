"""Tiny checkpoints and instruction data for the fine-tune tests, written once per session (no hub)."""

from __future__ import annotations

import pytest

from tests.train.finetune._checkpoints import write_chat, write_checkpoint, write_prompt_completion


@pytest.fixture(scope="session")
def ft_root(tmp_path_factory, adaptive_cache):
    return tmp_path_factory.mktemp("finetune")


@pytest.fixture(scope="session")
def tiny_llama(ft_root):
    """A Llama saved in fp32 (its merged export is fp32 too)."""
    return write_checkpoint(ft_root / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(ft_root):
    """A Qwen3 saved in bf16, as downloaded checkpoints are (its merged export is bf16)."""
    return write_checkpoint(ft_root / "tiny-qwen3", "qwen3", dtype="bfloat16")


@pytest.fixture(scope="session")
def chat_jsonl(ft_root):
    return write_chat(ft_root / "chat.jsonl")


@pytest.fixture(scope="session")
def prompt_completion_jsonl(ft_root):
    return write_prompt_completion(ft_root / "prompt_completion.jsonl")
