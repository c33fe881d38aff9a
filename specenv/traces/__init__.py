"""Trace sets: the schema, the validated tables, the shipped sets' registry, the paper's figures, the split."""
