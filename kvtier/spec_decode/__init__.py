"""Speculative decoding: draft tokens proposed cheaply, verified by the model in one step."""

from kvtier.spec_decode.config import SpeculativeConfig
from kvtier.spec_decode.drafts import DraftTracker, accept_drafts

__all__ = ["DraftTracker", "SpeculativeConfig", "accept_drafts"]
