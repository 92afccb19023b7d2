"""localllm: run open-weights language models on your own machine, fast."""

__version__ = "0.1.0"
