"""Choose a configuration: `fit(FitRequest) -> Plan` tries ZeRO stage, offload, micro-batch,
accumulation, checkpointing, sequence length and parallel sizes and keeps the fastest that fits
(planner), says how sure a fitting plan is (tight) and whether the orchestrator should run (advice).
It may import `architecture`, `hardware` and `estimate`. It never imports the DeepSpeed configs: a
user's file reaches it as the bucket sizes `planner.DeepSpeedBuckets` names."""
