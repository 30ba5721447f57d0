"""The family sweep: every ``*ForCausalLM`` class of the installed transformers, tiny, patched with every method."""
