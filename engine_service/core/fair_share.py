"""Fair share between tenants: whose request the scheduler admits next, and whose request gives way.

A tenant is who a request is for (``Request.tenant``, the API key's owner: ``sluice.wire.tenants``).
A tenant is *active* while the scheduler holds one of its requests, waiting or running. Each active
tenant has a **virtual time**: the service its requests got divided by its **weight** (the weight of
its latest request, 1 to ``tenants.MAX_WEIGHT``). Service is counted in tokens as the scheduler
schedules them (prefill chunks and decodes; recompute after a preemption included), each scheduled
chunk counting ``ROW_COST`` more: a request holding a row of a step pays for its share of the
step's pass over the weights, so a decode costs two tokens and a prefill chunk of n tokens n + 1
(the weights of "Fairness in Serving Large Language Models", Sheng et al., OSDI 2024: an output
token counts twice an input token). Counting tokens alone, a tenant of short prompts and short
outputs paid as much for a 16-token prefill as a flood for 16 of its decode rows, and was held back
behind a flood whose rows cost the engine more time. It is weighted fair queueing by that service:

- **Admission** takes the head of the waiting tenant with the least virtual time; within a tenant,
  requests keep their order (first come, first served; a preempted request goes back to the front
  of its own tenant's queue). Ties go to the tenant holding fewer slots by weight, then to the
  older head. When that head cannot be admitted, admission stops, as with one queue: the watermark
  may delay a request, never exclude it.
- **Joining** at the least virtual time of the active tenants (the tenant's own, were it higher, is
  forgotten with it when it went idle): an idle tenant banks no credit, and a newcomer is served
  next, but never owed a burst.
- **Giving way.** When the pool cannot grow a running request, the victim comes from the tenant
  furthest over its slot share (the most running requests by weight; ties: the larger virtual
  time), its youngest request among those not yet scheduled this step; never the oldest running
  request.
- **Taking a slot.** When every slot is taken, the tenant admission would pick next (the *taker*)
  may take one slot of the tenant furthest over its share (the *giver*) when it has been served no
  more than the giver (virtual time) and, after the move, still holds no more slots by weight
  (``(taker + 1) / w_taker <= (giver - 1) / w_giver``): the giver's youngest running request is
  preempted at the start of a step (never the oldest running request; never one scheduled in that
  step), and the taker's head is admitted in its place. Every move lowers ``sum(n_t^2 / w_t)`` over
  the tenants' running counts ``n_t``, so without new arrivals moves stop after a bounded number, a
  giver always keeps a slot, and a taker can never be taken from by the tenant it took from: nothing
  thrashes. With one active tenant none of this runs.

``FairView`` is the snapshot other threads read after each step: the engine's Redis reader takes
entries first from the queue lanes of the tenants with the least virtual time, and, beyond its
credit, one entry of each tenant with nothing waiting in the engine whose next request could take a
slot now (``FairView.may_take_slot``; at most ``FairView.slots_to_give`` of them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler's request; only its tenant, weight and arrival time are read here
    from engine_service.core.request import Request

# What a scheduled chunk costs beyond its tokens (the module's doc).
ROW_COST = 1


class TenantShare:
    """One active tenant in the scheduler: its weight, virtual time, waiting queue and counts."""

    __slots__ = ("name", "weight", "vtime", "waiting", "num_running", "num_requests")

    def __init__(self, name: str, weight: int, vtime: float) -> None:
        self.name = name
        self.weight = weight
        self.vtime = vtime
        self.waiting: deque[Request] = deque()  # first come, first served (preempted ones at the front)
        self.num_running = 0
        self.num_requests = 0  # waiting + running: the tenant leaves when it reaches 0

    def slots_by_weight(self) -> float:
        return self.num_running / self.weight

    def __repr__(self) -> str:
        return (f"TenantShare({self.name!r}, weight={self.weight}, vtime={self.vtime:.1f}, "
                f"waiting={len(self.waiting)}, running={self.num_running})")


def may_take_slot(taker_running: int, taker_weight: int, giver_running: int, giver_weight: int) -> bool:
    """Whether a tenant holding ``taker_running`` slots may take one of a tenant holding
    ``giver_running``: after the move the taker still holds no more slots by weight than the giver."""
    return (taker_running + 1) * giver_weight <= (giver_running - 1) * taker_weight


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """One active tenant as ``FairView`` shows it."""

    weight: int
    vtime: float
    waiting: int
    running: int


@dataclass(frozen=True)
class FairView:
    """The fair share after a step, immutable (safe to hand to other threads).

    ``tenants``: the active tenants. ``floor``: the virtual time a tenant joining now starts at.
    ``giver``: the tenant furthest over its slot share (None: no tenant runs anything).
    ``slots_to_give``: how many slots takers of weight 1 could take from the tenants now (one
    holding more than its weight in slots gives), less one per tenant here that waits and could
    take one: the most entries the reader may take beyond its credit."""

    tenants: Mapping[str, TenantLoad] = field(default_factory=lambda: MappingProxyType({}))
    floor: float = 0.0
    giver: str | None = None
    slots_to_give: int = 0

    def priority(self, tenant: str) -> tuple[float, float]:
        """Sort key of a tenant's queue lanes: least virtual time first (an absent tenant would
        join at ``floor``), then fewest slots by weight."""
        load = self.tenants.get(tenant)
        if load is None:
            return (self.floor, 0.0)
        return (load.vtime, load.running / load.weight)

    def may_take_slot(self, tenant: str) -> bool:
        """Whether the next request of ``tenant``, with nothing of it waiting here, could take a
        slot of the giver now (the module's rule; an absent tenant's weight is not known yet, and 1
        is the strictest)."""
        giver = self.tenants.get(self.giver) if self.giver is not None else None
        if giver is None or tenant == self.giver:
            return False
        load = self.tenants.get(tenant)
        if load is None:
            running, weight, vtime = 0, 1, self.floor
        elif load.waiting:
            return False  # it waits already: the scheduler moves with what it has
        else:
            running, weight, vtime = load.running, load.weight, load.vtime
        return vtime <= giver.vtime and may_take_slot(running, weight, giver.running, giver.weight)


EMPTY_VIEW = FairView()


class FairShare:
    """The active tenants and the policy's choices (the module's doc). The scheduler keeps the
    counts (``num_running``, ``num_requests``) and the waiting queues; this class decides."""

    def __init__(self) -> None:
        self.tenants: dict[str, TenantShare] = {}
        self._floor = 0.0  # the least virtual time when the last tenant left (a joiner's start then)

    def __len__(self) -> int:
        return len(self.tenants)

    def least_vtime(self) -> float:
        tenants = self.tenants
        if not tenants:
            return self._floor
        return min(t.vtime for t in tenants.values())

    def join(self, name: str, weight: int) -> TenantShare:
        """The tenant's share, made active at the least virtual time if it was not; its weight is
        the latest request's."""
        share = self.tenants.get(name)
        if share is None:
            share = self.tenants[name] = TenantShare(name, weight, self.least_vtime())
        else:
            share.weight = weight
        return share

    def leave(self, share: TenantShare) -> None:
        """The tenant holds no request any more: it goes idle and its virtual time is forgotten."""
        if self.tenants.get(share.name) is share:
            del self.tenants[share.name]
            if not self.tenants:
                self._floor = share.vtime

    @staticmethod
    def charge(share: TenantShare, tokens: int) -> None:
        share.vtime += tokens / share.weight

    def next_waiting(self) -> TenantShare | None:
        """The tenant whose head admission takes next (None: nobody waits)."""
        best: TenantShare | None = None
        best_key: tuple[float, float, float] | None = None
        for share in self.tenants.values():
            if share.waiting:
                key = (share.vtime, share.num_running / share.weight, share.waiting[0].arrival_time)
                if best_key is None or key < best_key:
                    best, best_key = share, key
        return best

    @staticmethod
    def furthest_over(shares: Iterable[TenantShare]) -> TenantShare | None:
        """The tenant furthest over its slot share: the most running requests by weight, ties the
        larger virtual time."""
        best: TenantShare | None = None
        for share in shares:
            if best is None or (share.num_running * best.weight, share.vtime) > (best.num_running * share.weight,
                                                                                   best.vtime):
                best = share
        return best

    def victim_index(self, running: list[Request], lo: int) -> int:
        """Of ``running[lo:]`` (admission order: the youngest last), the index of the youngest
        request of the tenant furthest over its share (-1: the slice is empty)."""
        if lo >= len(running):
            return -1
        tenants = self.tenants
        giver = self.furthest_over({tenants[r.tenant] for r in running[lo:]})
        for j in range(len(running) - 1, lo - 1, -1):
            if running[j].tenant == giver.name:
                return j
        return -1  # unreachable: the giver was taken from the slice

    def slot_move(self, running: list[Request]) -> tuple[TenantShare, int] | None:
        """With every slot taken: (the taker, the index in ``running`` of the giver's request to
        preempt), or None when no move is due (see the module's doc). ``running[0]``, the oldest, is
        never the one."""
        taker = self.next_waiting()
        if taker is None or len(running) < 2:
            return None
        # a giver holds two slots at least (may_take_slot), so one of them is not running[0]
        giver = self.furthest_over(s for s in self.tenants.values() if s is not taker)
        if giver is None or taker.vtime > giver.vtime \
                or not may_take_slot(taker.num_running, taker.weight, giver.num_running, giver.weight):
            return None
        for j in range(len(running) - 1, 0, -1):
            if running[j].tenant == giver.name:
                return taker, j
        return None

    def view(self) -> FairView:
        """The snapshot other threads read (the module's doc)."""
        tenants = self.tenants
        loads = {name: TenantLoad(s.weight, s.vtime, len(s.waiting), s.num_running) for name, s in tenants.items()}
        giver = self.furthest_over(tenants.values())
        givable = sum(max(0, s.num_running - s.weight) for s in tenants.values())
        if givable:  # less the tenants already here that wait to take a slot
            givable -= sum(1 for s in tenants.values() if s.waiting and s is not giver
                           and may_take_slot(s.num_running, s.weight, giver.num_running, giver.weight))
        return FairView(MappingProxyType(loads), self.least_vtime(), giver.name if giver is not None else None,
                        max(0, givable))
