"""What a run shows: metrics accumulated per step and written to metrics.jsonl (metrics), experiment
trackers through accelerate (trackers), and the progress bar with the log lines (display). It imports
no other part of `adaptive.train`."""
