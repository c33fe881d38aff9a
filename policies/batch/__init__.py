"""Batch controllers: one k per request of a batched step (heuristics, the goodput planner, learned)."""
