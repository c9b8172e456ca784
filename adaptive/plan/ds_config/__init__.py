"""DeepSpeed configs in and out: the one reader of a user's DeepSpeed JSON (reader, with the pydantic
shape of its sections in schema), used by `adaptive fit` and the recipes alike, and what a plan writes
(emit: DeepSpeed JSON, accelerate YAML, the plan as JSON). The reader imports nothing of the planner;
emit may import the search and everything below it."""
