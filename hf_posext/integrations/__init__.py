"""Integrations with other tools; each is imported only when used (its tool is an optional extra)."""
