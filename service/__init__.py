"""dflash-serving gateway: the OpenAI-compatible front door. Never imports torch or engine."""
