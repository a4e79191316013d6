"""The target service: the large model, its KV cache, feature capture and verification."""
