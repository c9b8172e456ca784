"""What one configuration costs, part by part: memory per GPU (memory, activations, attention,
optimizers, calibration), what each parallel layout holds and sends (parallel), and FLOPs, step time,
tokens/s and cost (throughput). Each figure is a pure function of a model, a GPU and a setup.
It may import `architecture` and `hardware`, never the search, the DeepSpeed configs or the evidence."""
