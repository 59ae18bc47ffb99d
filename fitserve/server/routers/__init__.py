"""The app's routes, one APIRouter per group: the OpenAI API (``openai``), vLLM's tokenizer
routes (``tokenize``), health/metrics/OpenAPI (``ops``) and the dashboard (``dashboard``).
Which of them need the API key is declared on each with ``Depends`` (``fitserve.server.auth``)."""
