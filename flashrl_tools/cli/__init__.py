"""The `flashrl` command line: thin typer shells over the Python API (one file per command)."""
