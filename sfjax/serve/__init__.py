"""``sfjax serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``sfjax.AsyncLLM``."""
