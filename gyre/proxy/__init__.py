"""The long-lived model-call proxy between harness sandboxes and engines (DESIGN.md, issue 5)."""
