"""OpenAI-compatible HTTP API (FastAPI): completions, chat, models, health, metrics."""
