"""What a run leaves on disk: one run owns its folder (ownership), checkpoints written atomically and
found again on resume (checkpoint), a run's HF export converted to other formats (export), and a
checkpoint folder read into a new run's model (init_from). It imports no other part of `adaptive.train`."""
