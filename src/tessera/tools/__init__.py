"""Command-line tools around the trainer: `.venv/bin/python -m tessera.tools.<name>` (estimate, ...)."""
