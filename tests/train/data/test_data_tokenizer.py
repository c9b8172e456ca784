"""The built-in offline tokenizer and `load_tokenizer`."""

from __future__ import annotations

import pytest

from adaptive.errors import AdaptiveError
from adaptive.train.data.tokenizer import (
    DEFAULT_CORPUS,
    EOS_TOKEN,
    PAD_TOKEN,
    build_default_tokenizer,
    default_tokenizer_dir,
    load_tokenizer,
    require_fits_vocab,
    train_bpe,
)


def test_default_tokenizer_build_is_deterministic():
    first, second = train_bpe(DEFAULT_CORPUS, 1024), train_bpe(DEFAULT_CORPUS, 1024)
    assert first.get_vocab() == second.get_vocab()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()  # merges included


def test_default_tokenizer_has_the_asked_vocab_and_special_tokens(tokenizer):
    assert len(tokenizer) == 2048
    assert tokenizer.eos_token == tokenizer.bos_token == EOS_TOKEN and tokenizer.pad_token == PAD_TOKEN
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1)
    assert len(train_bpe(DEFAULT_CORPUS, 512)) == 512


@pytest.mark.parametrize(
    "text",
    [
        "ABASEMENT, n.  A decent and customary mental attitude.",
        "  leading spaces, tabs\tand\nnew lines\n\n",
        "Ünïcödé, 日本語, emoji 🐉 and symbols ∑√",
    ],
)
def test_default_tokenizer_round_trips_text(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids


def test_default_tokenizer_is_cached_and_reloaded(tokenizer, adaptive_cache):
    folder = default_tokenizer_dir()
    assert folder.parent == adaptive_cache and (folder / "tokenizer.json").is_file()
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    again = build_default_tokenizer()
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert again.get_vocab() == tokenizer.get_vocab()
    assert default_tokenizer_dir(4096) != folder  # the vocab size is part of the key


def test_saved_tokenizer_loads_back_by_path(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "export")
    loaded = load_tokenizer(str(tmp_path / "export"))
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.bos_token_id) == (0, 1, 0)


def test_bad_tokenizer_names_are_one_line_errors(tmp_path):
    with pytest.raises(AdaptiveError, match="does not exist") as err:
        load_tokenizer(str(tmp_path / "missing") + "/")
    assert str(tmp_path / "missing") in str(err.value) and "\n" not in str(err.value)
    import huggingface_hub

    assert huggingface_hub.constants.HF_HUB_OFFLINE, "conftest must set HF_HUB_OFFLINE before the hub is imported"
    with pytest.raises(AdaptiveError, match="could not load tokenizer 'gpt2'") as err:
        load_tokenizer("gpt2")  # offline: the hub is not asked
    assert "\n" not in str(err.value)
    with pytest.raises(AdaptiveError, match="at least 258"):
        train_bpe(DEFAULT_CORPUS, 100)


def test_model_vocab_must_cover_the_tokenizer(tokenizer):
    require_fits_vocab(tokenizer, 2048)
    require_fits_vocab(tokenizer, 32000)  # a bigger embedding than the tokenizer is fine
    with pytest.raises(AdaptiveError, match="2048 tokens but the model's vocab_size is 2000"):
        require_fits_vocab(tokenizer, 2000)
