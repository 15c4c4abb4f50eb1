"""The installed command-line front ends (console scripts in pyproject.toml): argument parsing and
printing over the package, nothing else. `python tools/X.py` runs the same `main`."""
