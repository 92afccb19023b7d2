"""The torch runner: localllm's own transformer in PyTorch, reading the KV cache through
block tables. Only this package imports torch (and the `gguf` package for the weights)."""
