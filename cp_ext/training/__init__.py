"""The training loop and its components (batches, logging)."""
