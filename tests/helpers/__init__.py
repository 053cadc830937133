"""Shared test helpers: tiny models, PEFT adapters (models.py) and tokenizers (tokenizers.py)."""
