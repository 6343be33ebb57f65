"""Tensor parallelism: one engine over several ranks (one process each), rank 0 scheduling."""
