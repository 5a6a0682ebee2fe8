"""Strategies register and are granted certificates: an exactness class and the sampling modes
they are certified for. A request names a granted strategy (or none); one that names an ungranted
strategy, or demands more exactness than the strategy's class gives, is refused at admission.
"""

from __future__ import annotations

import dataclasses

# Weakest to strongest.
CLASSES = ("lossy", "distribution-exact", "path-exact")


@dataclasses.dataclass(frozen=True)
class Certificate:
    strategy: str                       # "draft_model/exact", "ngram/typical_acceptance_sampler", ...
    exactness: str                      # one of CLASSES
    sampling_modes: tuple[str, ...]     # "greedy", "gumbel": the modes the class holds for

    def covers(self, demanded: str | None, greedy: bool) -> bool:
        """Whether a request with this demand and mode gets at least the demanded class."""
        if demanded is None:
            return True
        mode = "greedy" if greedy else "gumbel"
        return mode in self.sampling_modes and CLASSES.index(self.exactness) >= CLASSES.index(demanded)


@dataclasses.dataclass(frozen=True)
class Strategy:
    method: str                         # proposer
    acceptance: str                     # acceptance rule
    needs_every_position: bool = True   # verification at every drafted position
    needs_partial_rollback: bool = True # rollback to any accepted length

    @property
    def name(self) -> str:
        return f"{self.method}/{self.acceptance}"


_RULES = {
    "exact": ("path-exact", ("greedy", "gumbel")),
    "rejection_sampler": ("distribution-exact", ("greedy", "gumbel")),
    # Medusa's typical acceptance equals plain decoding only at temperature 0.
    "typical_acceptance_sampler": ("lossy", ("greedy",)),
}

PLAIN = Certificate("none", "path-exact", ("greedy", "gumbel"))

# What this engine's step gives every backend: it verifies all k+1 positions in one target
# forward and rolls back by moving a length, so any accepted prefix is kept.
BACKEND_CAPABILITIES = {"every_position": True, "partial_rollback": True}

class Registry:
    """An engine's strategies, each in a slot with its certificate; slot 0 is plain decoding."""

    def __init__(self, capabilities: dict[str, bool] = BACKEND_CAPABILITIES):
        self.capabilities = dict(capabilities)
        self.slots: list[Certificate] = [PLAIN]

    def register(self, strategy: Strategy) -> int:
        """Grants ``strategy`` a slot and its certificate; raises ValueError where the backend
        can't hold its class."""
        if strategy.acceptance not in _RULES:
            raise ValueError(f"no exactness rule is known for acceptance {strategy.acceptance!r}")
        if strategy.needs_every_position and not self.capabilities.get("every_position"):
            raise ValueError(f"{strategy.name}: refused, the backend cannot verify at every drafted position")
        if strategy.needs_partial_rollback and not self.capabilities.get("partial_rollback"):
            raise ValueError(f"{strategy.name}: refused, the backend cannot roll back partially")
        exactness, modes = _RULES[strategy.acceptance]
        self.slots.append(Certificate(strategy.name, exactness, modes))
        return len(self.slots) - 1

    def lookup(self, name: str) -> int:
        for i, cert in enumerate(self.slots):
            if cert.strategy == name:
                return i
        granted = [c.strategy for c in self.slots]
        raise ValueError(f"spec_strategy {name!r} is not granted in this engine (granted: {granted})")
