"""Residency levers: where weights live and how they move (pinned host store, phase offload, group prefetch)."""
