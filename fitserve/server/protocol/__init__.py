"""Pydantic models of the HTTP API fitserve serves (vLLM's ``entrypoints/openai/protocol.py``),
one module per endpoint family: ``completions`` and ``chat`` (requests, responses, stream
chunks), ``structured`` (structured output and tool calling), ``tokenize`` (vLLM's tokenizer
routes), and ``common`` (the limits, the shared sampling fields, usage, errors, the model list).
They validate the requests and make up the schemas of the OpenAPI document
(``fitserve.server.openapi``)."""
