"""The coordinator's OpenAI-compatible HTTP front (issue 20): the API that the `openai` SDK, LangChain,
Open WebUI, `vllm bench serve` and AIPerf speak, over the same generations as the gRPC service.

    protocol.py   the OpenAI request and response shapes, the parameters, the error object
    chat.py       chat messages -> prompt text with the target's chat template (jinja2, as transformers)
    app.py        the routes (Starlette), one generation per choice on a thread of its own
    server.py     uvicorn on --host:--http-port in the coordinator process, stopped after the drain
"""
