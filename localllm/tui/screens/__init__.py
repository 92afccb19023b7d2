"""One modal screen per module."""
