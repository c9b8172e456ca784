"""What the planner is checked and calibrated against: published training runs with what `fit`
predicts for each (corpus, corpus_runs.json), and a real run's measurements turned into a calibration
(run_calibration). It sits above the search and the DeepSpeed configs, and nothing in the planner
below `adaptive.plan.request` imports it."""
