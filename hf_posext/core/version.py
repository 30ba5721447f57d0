"""The package version (one place; ``hf_posext.__version__`` re-exports it)."""

VERSION = "0.1.0"
