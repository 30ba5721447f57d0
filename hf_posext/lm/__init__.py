"""Layer 5: torch-only helpers shared by evaluation, search and training (no results files, no CLI)."""
