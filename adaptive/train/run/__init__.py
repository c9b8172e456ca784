"""One training run: size it (runplan), build it (setup), step it (loop), with the contract its
callbacks and the orchestrator's policies see (callbacks), Ulysses sequence parallelism
(sequence_parallel), and the entry a recipe calls (entry). It may import `data`, `run_folder` and
`reporting`; none of them imports it."""
