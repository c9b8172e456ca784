"""A size ladder: dense decoder shapes between and beyond the presets, built by the presets' own rules.

The presets follow Llama's family rules: head size 64 up to a 2048-wide model and 128 above (32 for the
tiniest), a quarter as many KV heads as query heads (at most 8), an FFN 8/3 as wide as the model rounded up
to 256 (Llama's rule; 64 below 1024), and depth growing as the square root of the width up to 2048 (b1: 20
layers) and linearly above it (~100 wide per layer, as b14 and b70). The budget search and `adaptive scale`
pick from this ladder; each rung builds as any arch with `spec_from_shape`.
"""

from __future__ import annotations

import math

from adaptive.plan.architecture.presets import PRESETS, Shape

WIDTHS = (64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3072, 3584, 4096,
          5120, 6144, 7168, 8192, 10240, 12288, 16384)


def head_dim_for(width: int) -> int:
    return 32 if width < 256 else 64 if width <= 2048 else 128


def layers_for(width: int) -> int:
    if width <= 2048:
        return max(2, round(math.sqrt(width) * 20 / math.sqrt(2048)))
    return round(width / 102.4)


def ffn_for(width: int) -> int:
    multiple = 64 if width < 1024 else 256
    return math.ceil(8 * width / 3 / multiple) * multiple


def kv_heads_for(heads: int) -> int:
    target = min(8, max(1, heads // 4))
    return max(k for k in range(1, target + 1) if heads % k == 0)


def params_name(params: float) -> str:
    """'s125m', 's1.3b': a rung's name from its dense parameter count."""
    if params >= 1e9:
        return f"s{params / 1e9:.3g}b"
    return f"s{params / 1e6:.3g}m"


def rung(width: int, vocab_size: int = 32000, layers: int | None = None, max_position_embeddings: int = 4096) -> Shape:
    """The ladder's dense shape at `width` (and optionally another depth)."""
    heads = width // head_dim_for(width)
    layers = layers or layers_for(width)
    ffn = ffn_for(width)
    params = dense_params(vocab_size, width, ffn, layers, heads, kv_heads_for(heads))
    return Shape(params_name(params), params, vocab_size=vocab_size, hidden_size=width, intermediate_size=ffn,
                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads_for(heads),
                 max_position_embeddings=max_position_embeddings)


def dense_params(vocab: int, width: int, ffn: int, layers: int, heads: int, kv_heads: int) -> int:
    head = width // heads
    attention = 2 * width * heads * head + 2 * width * kv_heads * head
    return 2 * vocab * width + width + layers * (attention + 3 * width * ffn + 2 * width)


def _key(s: Shape) -> tuple:
    return (s.vocab_size, s.hidden_size, s.intermediate_size, s.num_hidden_layers, s.num_attention_heads,
            s.num_key_value_heads)


def ladder(min_params: float = 0.0, max_params: float = math.inf, vocab_size: int = 32000,
           with_presets: bool = True) -> list[Shape]:
    """Every rung (and the named presets from debug_200m up, when `with_presets`) whose dense count lies in
    [min_params, max_params], smallest first."""
    shapes = [rung(w, vocab_size) for w in WIDTHS]
    if with_presets and vocab_size == 32000:  # a rung with a preset's shape takes the preset's name
        presets = {_key(s): s for name, s in PRESETS.items() if name != "debug"}
        shapes = [presets.pop(_key(s), s) for s in shapes] + list(presets.values())
    sized = [(dense_params(s.vocab_size, s.hidden_size, s.intermediate_size, s.num_hidden_layers,
                           s.num_attention_heads, s.num_key_value_heads), s) for s in shapes]
    return [s for n, s in sorted(sized, key=lambda x: x[0]) if min_params <= n <= max_params]
