"""Tandem: EAGLE-3 speculative decoding with the target and the draft in separate processes.

This package is the core the three services share, torch-free at import: request types, the round
loop and its K policy, protobuf conversion, typed errors, the service bootstrap, config, the feature
transports. The services live in `target_server`, `draft_server` and `coordinator`; the tools on top
of them (the `tandem` command, bench, load, profile, demo) in `tandem_tools`. See docs/architecture.md.
"""

__version__ = "0.1.0"
