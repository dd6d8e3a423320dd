"""vertumnus: an adaptive context-parallel prefill pool for LLM serving."""

__version__ = "0.1.0"
