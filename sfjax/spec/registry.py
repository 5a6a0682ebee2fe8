"""Strategies register and are granted certificates: an exactness class and the sampling modes
they are certified for. A request names a granted strategy (or none); one that names an ungranted
strategy, or demands more exactness than the strategy's class gives, is refused at admission.
"""

from __future__ import annotations

import dataclasses

from sfjax.spec.accept import RULES

# Weakest to strongest.
CLASSES = ("lossy", "distribution-exact", "path-exact")


@dataclasses.dataclass(frozen=True)
class Certificate:
    """What a strategy is granted: an exactness class per sampling mode it is certified for
    ("greedy": temperature 0; "gumbel": Gumbel-max sampling)."""
    strategy: str                              # "draft_model/exact", "ngram/typical_acceptance_sampler", ...
    modes: tuple[tuple[str, str], ...]         # ((mode, class), ...)

    @property
    def exactness(self) -> str:
        """The class it holds in every certified mode (the weakest)."""
        return min((c for _, c in self.modes), key=CLASSES.index)

    def class_for(self, greedy: bool) -> str | None:
        return dict(self.modes).get("greedy" if greedy else "gumbel")

    def covers(self, demanded: str | None, greedy: bool) -> bool:
        """Whether a request with this demand and sampling mode gets at least the demanded class."""
        if demanded is None:
            return True
        got = self.class_for(greedy)
        return got is not None and CLASSES.index(got) >= CLASSES.index(demanded)


@dataclasses.dataclass(frozen=True)
class Strategy:
    method: str                         # proposer
    acceptance: str                     # acceptance rule
    needs_every_position: bool = True   # verification at every drafted position
    needs_partial_rollback: bool = True # rollback to any accepted length

    @property
    def name(self) -> str:
        return f"{self.method}/{self.acceptance}"


# the class each acceptance rule holds per sampling mode (``spec.accept``)
_RULES = {name: rule.modes for name, rule in RULES.items()}

PLAIN = Certificate("none", (("greedy", "path-exact"), ("gumbel", "path-exact")))

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
        self.slots.append(Certificate(strategy.name, _RULES[strategy.acceptance]))
        return len(self.slots) - 1

    def lookup(self, name: str) -> int:
        for i, cert in enumerate(self.slots):
            if cert.strategy == name:
                return i
        granted = [c.strategy for c in self.slots]
        raise ValueError(f"spec_strategy {name!r} is not granted in this engine (granted: {granted})")
