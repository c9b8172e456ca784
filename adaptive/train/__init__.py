"""The training side: data, loop, checkpoints, export. Submodules import torch and HF libraries;
import them directly (`from adaptive.train.data import build_datasets`)."""
