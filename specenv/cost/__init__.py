"""The cost model of a round (single request, batch) and its fits on the rounds/steps tables."""
