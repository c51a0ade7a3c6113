"""Embedded DFlash worker: a pure-PyTorch engine that speaks the same HTTP API as vLLM."""
