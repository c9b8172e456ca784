"""The model a plan is for: presets and architectures (presets), block types (blocks), analytic parameter
counts (params), and a transformers `config.json` read into the same `ModelSpec` (hf_config, hf_fields).
Pure data and arithmetic: it imports nothing else of `adaptive.plan`, and no torch."""
