"""What a run buys: the loss it should reach. Published scaling laws as data (each with its source, its
coefficients, what it counts as N and the range it was fitted on), the effects we state where there is no
law (MoD, hybrid), repeated data, a law fitted on the user's own data (`adaptive scale` writes it), and
compute-optimal batch size and learning rate. Pure Python, no torch. It may import `architecture` and
`estimate` (FLOPs per token), never the search, the DeepSpeed configs or the evidence."""
