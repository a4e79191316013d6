"""The coordinator: runs the round loop between the target and draft services and serves clients.

It relays token ids and features; it holds no weights and needs no torch.
"""
