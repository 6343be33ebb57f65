"""Model building blocks: attention, rotary embedding, norms, activations."""
