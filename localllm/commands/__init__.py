"""One module per CLI command; each takes plain values, never argparse results."""
