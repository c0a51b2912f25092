"""Drafting heads on the target's own hidden state (`--proposer head`): the heads, their file format,
teacher-forced features and training (`verispec train-head`)."""

from verispec.heads.medusa import MedusaHeads, load_heads, save_heads

__all__ = ["MedusaHeads", "load_heads", "save_heads"]
