"""The coordinator's OpenAI-compatible HTTP front: the API that the `openai` SDK, LangChain, Open WebUI,
`vllm bench serve` and AIPerf speak, over the same generations as the gRPC service.

    fields.py     nulls as absent, and the fields of both APIs Tandem refuses unless neutral
    protocol.py   the OpenAI request and response shapes, the parameters, the error object
    app.py        the routes (Starlette)
    answer.py     a response from its choices, whole or as server-sent events
    choice.py     one generation per choice, on a thread of its own
    tokens.py     /tokenize, /detokenize and /version, as vLLM has them
    auth.py       API keys and bounded bodies, in front of the routes
    server.py     uvicorn on --host:--http-port in the coordinator process, stopped after the drain
The chat template is rendered by coordinator/chat.py (jinja2, as transformers renders it), shared with gRPC.
"""
