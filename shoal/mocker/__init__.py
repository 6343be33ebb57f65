"""A simulated engine: the real scheduler and KV block pool, with a timing model in place
of the GPU, so routing, disaggregation and planning can be tested at scale on a CPU."""
