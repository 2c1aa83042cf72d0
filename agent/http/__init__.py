"""The public HTTP API: OpenAI and Ollama endpoints, cluster and model management, the dashboard, metrics."""
