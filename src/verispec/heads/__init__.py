"""Drafting heads on the target's own hidden state (`--proposer head`): Medusa heads and the
EAGLE-style layer, their file format, teacher-forced features and training (`verispec train-head`)."""

from verispec.heads.eagle import EagleHead, save_head
from verispec.heads.files import load_heads, shipped_heads
from verispec.heads.medusa import MedusaHeads, save_heads

__all__ = ["EagleHead", "MedusaHeads", "load_heads", "save_head", "save_heads", "shipped_heads"]
