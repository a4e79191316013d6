"""The draft service: the EAGLE-3 head, its own KV cache and the K-step rollout."""
