"""`localllm serve`: the OpenAI-compatible HTTP door (FastAPI + uvicorn)."""
