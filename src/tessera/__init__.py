"""Tessera: pre-train decoder LLMs with JAX on anything from one CPU to thousands of chips."""

__version__ = "0.1.0"
