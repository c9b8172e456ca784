"""The hardware a plan runs on: the GPU catalog (gpus) and each GPU class's assumed figures with their
sources (figures). It imports nothing else of `adaptive.plan`, and no torch."""
