"""The training side, in four parts: `data` (text to micro-batches), `run` (size, build and step one
run), `run_folder` (what a run leaves on disk) and `reporting` (what it shows), plus `hf_trainer`, the
orchestrator's policies on a transformers `Trainer`. Modules import torch and HF libraries; import them
directly (`from adaptive.train.data.packing import build_datasets`)."""
