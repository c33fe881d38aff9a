"""The observation contracts: one request's vector (single) and the batch layout on top of it."""
