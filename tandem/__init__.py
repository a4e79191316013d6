"""Tandem: EAGLE-3 speculative decoding with the target and the draft in separate processes.

This package holds what all three services share: request parameters, the pairing check,
the tiny-model builder and the command line. The services live in `target_server`,
`draft_server` and `coordinator`.
"""

__version__ = "0.1.0"
