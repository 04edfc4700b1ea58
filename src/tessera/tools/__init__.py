"""Command-line tools around the trainer: `python3 -m tessera.tools.<name>` (estimate, ...)."""
