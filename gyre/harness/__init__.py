"""Running unmodified agent harnesses against the proxy (only what the tests need so far)."""
