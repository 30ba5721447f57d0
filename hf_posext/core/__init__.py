"""Layer 2: the scaling request, the saved record, config snapshots and errors (no model surgery)."""
