"""Tasks: specs and task sets (`spec`), evaluators (`evaluate`), the embedded toy set and its warm start."""
