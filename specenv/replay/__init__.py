"""Replay tables of a trace set under a cost model, and the episode that plays rounds on them."""
