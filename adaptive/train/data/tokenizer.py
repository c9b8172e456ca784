"""Tokenizers for training: a hub name or local folder, or the built-in offline default.

The default is a byte-level BPE trained with `tokenizers` on the shipped public-domain corpus
(`adaptive/data/`). It needs no network, builds in well under a second, and is cached on disk so
every rank and every later run loads the same files:

    $ADAPTIVE_CACHE/tokenizer-<hash>/        (default ~/.cache/adaptive, or $XDG_CACHE_HOME/adaptive)

The hash covers the corpus bytes, the vocab size, the recipe version below and the `tokenizers`
version, so a change to any of them builds a new folder instead of reusing a stale one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from adaptive.errors import AdaptiveError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "data" / "devils_dictionary.txt"
DEFAULT_VOCAB_SIZE = 2048
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)  # ids 0 and 1, before the 256 byte symbols
_RECIPE_VERSION = "bytelevel-bpe-v1"  # bump when the build below changes its output
_MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # every byte must be representable


def cache_root() -> Path:
    """Where adaptive caches built artefacts: $ADAPTIVE_CACHE, else $XDG_CACHE_HOME/adaptive."""
    if os.environ.get("ADAPTIVE_CACHE"):
        return Path(os.environ["ADAPTIVE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "adaptive"


def default_tokenizer_dir(vocab_size: int = DEFAULT_VOCAB_SIZE, corpus: Path = DEFAULT_CORPUS) -> Path:
    """The cache folder the default tokenizer for this vocab size and corpus lives in."""
    import tokenizers

    digest = hashlib.sha256()
    for part in (_RECIPE_VERSION, str(vocab_size), tokenizers.__version__):
        digest.update(part.encode() + b"\0")
    digest.update(Path(corpus).read_bytes())
    return cache_root() / f"tokenizer-{digest.hexdigest()[:16]}"


def train_bpe(corpus: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus` (no caching). Deterministic for a given corpus and size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < _MIN_VOCAB:
        raise AdaptiveError(f"vocab_size {vocab_size} is too small for byte-level BPE; use at least {_MIN_VOCAB}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes up front, so any text (any language, any symbol) encodes without <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Paragraphs, not the whole file: the trainer counts words per item, and this keeps items small.
    paragraphs = Path(corpus).read_text(encoding="utf-8").split("\n\n")
    backend.train_from_iterator(paragraphs, trainer=trainer, length=len(paragraphs))
    if backend.get_vocab_size() < vocab_size:
        # A small corpus runs out of pairs worth merging; the model's embedding may be larger.
        logger.warning(
            "the default tokenizer has %d tokens, fewer than the %d asked for: %s has no more merges",
            backend.get_vocab_size(), vocab_size, Path(corpus).name,
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=None
    )


def build_default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, corpus: Path = DEFAULT_CORPUS) -> PreTrainedTokenizerFast:
    """The built-in tokenizer: loaded from its cache folder, or trained and saved there first.

    Safe when several ranks call it at once: each trains into a private temporary folder and the
    first to rename it into place wins; the others load the winner's files, so all ranks agree.
    """
    from transformers import PreTrainedTokenizerFast

    target = default_tokenizer_dir(vocab_size, corpus)
    if not (target / "tokenizer.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            train_bpe(corpus, vocab_size).save_pretrained(tmp)
            try:
                tmp.rename(target)
                logger.info("built the default tokenizer (vocab %d) in %s", vocab_size, target)
            except OSError:  # another process got there first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(str(target))


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~", ".\\")) or name.endswith(("/", ".json"))


def load_tokenizer(name_or_path: str | None, vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A fast tokenizer with eos, bos and pad set.

    None → the built-in byte-level BPE (`vocab_size` tokens at most). Otherwise a local folder or a
    hub name, through `AutoTokenizer.from_pretrained` (`vocab_size` does not apply; check the
    result against the model with `require_fits_vocab`). A folder that exists wins over a hub name.
    A tokenizer without a pad token gets eos as pad, and one without bos gets eos as bos (the GPT-2
    convention); one without eos is refused, because packing separates documents with it.
    """
    if name_or_path is None:
        return build_default_tokenizer(vocab_size)

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    local = Path(name_or_path).expanduser()
    if not local.exists() and _looks_like_path(name_or_path):
        raise AdaptiveError(f"tokenizer path {name_or_path!r} does not exist; pass a folder with tokenizer.json or a hub name")
    source = str(local) if local.exists() else name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:  # hub unreachable, unknown name, folder without tokenizer files
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = "folder" if local.exists() else "hub name (offline or unknown?)"
        raise AdaptiveError(
            f"could not load tokenizer {name_or_path!r} as a {where}: {cause}; "
            "pass a local tokenizer folder, or omit --tokenizer for the built-in one"
        ) from None
    if not tokenizer.get_vocab() or not tokenizer("The quick brown fox.")["input_ids"]:
        # transformers builds an empty tokenizer from a folder with a config.json and no vocabulary files
        raise AdaptiveError(f"tokenizer {name_or_path!r} has no vocabulary (no tokenizer.json, or vocab and merges "
                            "files); pass a folder that `tokenizer.save_pretrained` wrote")
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise AdaptiveError(f"tokenizer {name_or_path!r} has no fast (tokenizers) backend; use one with tokenizer.json")
    if tokenizer.eos_token_id is None:
        raise AdaptiveError(f"tokenizer {name_or_path!r} has no eos token; packing needs one to separate documents")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.bos_token_id is None:
        tokenizer.bos_token = tokenizer.eos_token
    return tokenizer


def require_fits_vocab(tokenizer: PreTrainedTokenizerFast, model_vocab_size: int) -> None:
    """Refuse a tokenizer whose ids would index past the model's embedding (a larger model vocab is fine)."""
    if len(tokenizer) > model_vocab_size:
        raise AdaptiveError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {model_vocab_size}; "
            f"use a model vocab of at least {len(tokenizer)} or a smaller tokenizer"
        )


__all__ = [
    "DEFAULT_CORPUS",
    "DEFAULT_VOCAB_SIZE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "build_default_tokenizer",
    "cache_root",
    "default_tokenizer_dir",
    "load_tokenizer",
    "require_fits_vocab",
    "train_bpe",
]
