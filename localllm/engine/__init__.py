"""The engine: one model, many generation streams, one step at a time."""
