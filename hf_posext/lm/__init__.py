"""Language-model building blocks that work on any causal LM (losses that avoid full logits)."""
