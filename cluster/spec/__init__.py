"""Speculative decoding, engine side: n-gram drafts and the rules for when to draft."""
from cluster.spec.drafter import Drafter
from cluster.spec.ngram import NgramIndex, NgramProposer

__all__ = ["Drafter", "NgramIndex", "NgramProposer"]
