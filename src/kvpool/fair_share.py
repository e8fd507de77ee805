"""How tenants share one server: weighted dominant-resource fairness over the batch and the KV pool.

A scheduler serving several tenants has two things to share: the slots of
the running batch (``max_num_seqs``) and the KV pool's tokens. Each tenant
``t`` with unfinished requests is *active* and has a weight ``w_t`` (1 unless
the operator's key file says otherwise). The rule, the one home of it:

* a tenant's **dominant share** is the larger of its running sequences over
  ``max_num_seqs`` and the context its running sequences hold (prompt and
  output tokens) over the pool's tokens, as in dominant-resource fairness
  (Ghodsi et al., NSDI 2011);
* its **fair share** is ``w_t / sum(w)`` over the active tenants, and its
  **load** is dominant share over fair share: below 1 it has less than its
  share, above 1 more;
* **admission** takes the next waiting request of the tenant with the lowest
  load (each tenant's own requests in arrival order, preempted ones first), so
  a tenant over its share waits before another tenant's first request does;
* **preemption**, when a step runs out of blocks, takes the most recently
  admitted request of the tenant with the highest load; and a waiting request
  of a tenant that would stay at or under its share after admission may
  preempt requests of a tenant over its share to get in;
* **a step's token budget** is split by weight among the tenants that have
  work in it, so one tenant's long prefill never makes every other tenant's
  step wait for it; a tenant alone gets the whole budget.

A request's ``n`` sequences are all its tenant's load. With one tenant (or
none named) nothing of this applies: the scheduler makes vLLM's first come,
first served decisions, block for block.

Standard library only; pure arithmetic on counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvpool.errors import ConfigError

__all__ = ["MAX_WEIGHT", "StepShares", "TenantWeights", "check_weight", "split_budget", "tenant_load"]

#: The largest weight a tenant may have (a share 10,000 times another's is as good as all of it).
MAX_WEIGHT = 10_000.0


def check_weight(what: str, weight: object) -> float:
    """``weight`` as a float, refused (naming ``what``) unless a number in ``(0, MAX_WEIGHT]``."""
    if not isinstance(weight, (int, float)) or type(weight) is bool or not (0 < weight <= MAX_WEIGHT):
        raise ConfigError(f"{what} must be a number in (0, {MAX_WEIGHT:g}], got {weight!r}")
    return float(weight)


@dataclass(frozen=True, slots=True)
class TenantWeights:
    """Each tenant's weight in the fair share; a tenant not named has ``default``.

    ``TenantWeights({"alice": 2})`` gives alice twice the share of any other tenant.
    """

    weights: Mapping[str, float] = field(default_factory=dict)
    default: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.weights, Mapping):
            raise ConfigError(f"tenant weights must map tenant names to numbers, got {self.weights!r}")
        checked = {}
        for tenant, weight in self.weights.items():
            if not isinstance(tenant, str) or not tenant:
                raise ConfigError(f"a tenant name is a non-empty string, got {tenant!r}")
            checked[tenant] = check_weight(f"the weight of tenant {tenant!r}", weight)
        object.__setattr__(self, "weights", MappingProxyType(checked))
        object.__setattr__(self, "default", check_weight("the default tenant weight", self.default))

    def weight(self, tenant: str | None) -> float:
        return self.weights.get(tenant, self.default) if tenant is not None else self.default


def tenant_load(sequences: int, tokens: int, *, max_seqs: int, pool_tokens: int, fair_share: float) -> float:
    """A tenant's dominant share over its fair share (above 1: more than its share)."""
    return max(sequences / max_seqs, tokens / pool_tokens) / fair_share


def split_budget(budget: int, weights: Mapping[str | None, float]) -> dict[str | None, int]:
    """``budget`` tokens split by weight among the tenants in ``weights`` (each gets at least one token).

    The parts are floors of the exact shares, so they never add up to more
    than ``budget`` (unless there are more tenants than tokens).
    """
    total = sum(weights.values())
    return {tenant: max(1, int(budget * weight / total)) for tenant, weight in weights.items()}


class StepShares:
    """The tenants' loads and token budgets during one scheduling step (see the module docstring).

    Built at the start of a step from what runs; the scheduler tells it every
    admission, preemption and scheduled chunk, and asks it whom to admit next
    and whom to preempt.

    Args:
        weights: the tenants' weights.
        active: the tenants with unfinished requests (running or waiting).
        running: (tenant, context tokens) of every running sequence.
        max_seqs: the batch's slots.
        pool_tokens: the KV pool's tokens.
        budget: the step's token budget, split among ``active`` by weight.
    """

    __slots__ = ("_blocked", "_fair", "_max_seqs", "_pool_tokens", "_seqs", "_tokens", "left")

    def __init__(
        self,
        weights: TenantWeights,
        active: Iterable[str | None],
        running: Iterable[tuple[str | None, int]],
        *,
        max_seqs: int,
        pool_tokens: int,
        budget: int,
    ) -> None:
        shares = {tenant: weights.weight(tenant) for tenant in active}
        total = sum(shares.values())
        self._fair = {tenant: weight / total for tenant, weight in shares.items()}
        #: Tokens each tenant may still schedule in this step.
        self.left = split_budget(budget, shares)
        self._max_seqs = max_seqs
        self._pool_tokens = max(1, pool_tokens)
        self._seqs = dict.fromkeys(shares, 0)
        self._tokens = dict.fromkeys(shares, 0)
        for tenant, tokens in running:
            self._seqs[tenant] += 1
            self._tokens[tenant] += tokens
        self._blocked: set[str | None] = set()

    def load(self, tenant: str | None, *, seqs: int = 0, tokens: int = 0) -> float:
        """``tenant``'s load, with ``seqs`` sequences of ``tokens`` tokens more."""
        return tenant_load(
            self._seqs[tenant] + seqs,
            self._tokens[tenant] + tokens,
            max_seqs=self._max_seqs,
            pool_tokens=self._pool_tokens,
            fair_share=self._fair[tenant],
        )

    def pick(self, waiting: Iterable[str | None]) -> str | None:
        """The tenant to admit from next, of the tenants of ``waiting`` (in queue order): the lowest load
        that still has budget and was not turned away in this step; ties go to the one queued first."""
        best: tuple[float, int, str | None] | None = None
        seen: set[str | None] = set()
        for order, tenant in enumerate(waiting):
            if tenant in seen:
                continue
            seen.add(tenant)
            if tenant in self._blocked or self.left[tenant] <= 0:
                continue
            key = (self.load(tenant), order, tenant)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else best[2]

    def victim(self, tenant: str | None, tokens: int) -> str | None:
        """Whom to preempt so that a waiting sequence of ``tenant`` with ``tokens`` tokens gets in: the
        tenant with the highest load above its share, unless admitting would put ``tenant`` itself over
        its share (then it waits like anyone); None when nobody is to be preempted."""
        if self.load(tenant, seqs=1, tokens=tokens) > 1.0:
            return None
        best: tuple[float, str | None] | None = None
        for other, seqs in self._seqs.items():
            if other == tenant or not seqs:
                continue
            load = self.load(other)
            if load > 1.0 and (best is None or load > best[0]):
                best = (load, other)
        return None if best is None else best[1]

    def block(self, tenant: str | None) -> None:
        """``tenant``'s next request could not get in: admit nothing more of it in this step."""
        self._blocked.add(tenant)

    def admitted(self, tenant: str | None, tokens: int) -> None:
        self._seqs[tenant] += 1
        self._tokens[tenant] += tokens

    def preempted(self, tenant: str | None, tokens: int) -> None:
        self._seqs[tenant] -= 1
        self._tokens[tenant] -= tokens
