"""The embedded worker: vLLM's OpenAI HTTP API over the engine core (the only layer that
turns engine exceptions into HTTP errors)."""
