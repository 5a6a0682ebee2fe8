"""Speculative decoding: configuration, proposers, acceptance rules and their certificates."""

from sfjax.spec.config import SpeculativeConfig
from sfjax.spec.registry import Certificate, Registry, Strategy

__all__ = ["SpeculativeConfig", "Certificate", "Registry", "Strategy"]
