"""`adaptive scale`: scaling laws fitted on the user's own data.

An isoFLOP sweep of small models (`grid`), each point one ordinary recipe run in its own run folder
(`runner`, `point`), its state in sweep.json after every point (`state`), so Ctrl-C and a rerun continue it
(`sweep`). One law across the architectures, L(N, D) = E + A/(k N)^alpha + B/D^beta with a multiplier k per
arch, is fitted as Chinchilla's approach 3 did (`fit_law`), written as law.json (adaptive.plan.quality.law_file),
and drawn (`plot`). The planner never imports this package; it reads the law.json.
"""
