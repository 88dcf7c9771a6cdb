"""Pipeline schedules as plans (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): per pipeline rank, the
list of its actions, F (a forward), B (a backward's input gradient, which the previous stage waits for) and W (its
weight gradients, which nobody waits for), each of one model chunk and micro-batch; the sends and receives follow
from them (an F's output goes to the next stage, a B's input gradient to the previous one).

A plan is made by simulating the pipeline with unit costs (F = B = W = 1): each rank keeps 1F1B's order of F's and
B's and fills a wait with a W it owes (a W it owes also goes first where one more F would keep more micro-batches
alive than 1F1B's first stage does, p), so ZB-H1's peak activation memory is 1F1B's (the paper's H1) and its bubble
(p - 1)(F + B - W) instead of (p - 1)(F + B + W); 1f1b's plan runs each W right after its B (and its
simulation sends the input gradient after both, as 1F1B's one backward does). check_plan proves a plan runs:
every (chunk, micro-batch) of a rank has one F, one B and one W in that order, each chunk's in micro-batch order;
every receive meets a send (no rank waits for one never issued, no circle of waits); and between two ranks the
messages are received in the order they are sent (as NCCL matches them)."""

import dataclasses
import functools

F, B, W = "F", "B", "W"


@dataclasses.dataclass(frozen=True)
class Action:
    op: str  # F | B | W
    chunk: int
    mb: int

    def __repr__(self):
        return f"{self.op}{self.mb}" + (f"c{self.chunk}" if self.chunk else "")


class PlanError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Plan:
    actions: tuple  # per pipeline rank, its actions in order
    finish: dict  # (rank, Action) -> its end in the simulation's time units
    makespan: float

    def idle_fraction(self, rank):
        busy = sum(1 for _ in self.actions[rank])  # (unit costs)
        return 1 - busy / self.makespan

    def most_alive(self, rank):
        """The most micro-batches whose activations `rank` holds at once (from its F until its W)."""
        alive = most = 0
        for a in self.actions[rank]:
            alive += {F: 1, B: 0, W: -1}[a.op]
            most = max(most, alive)
        return most


def one_f_one_b_order(p, m, rank):
    """1F1B's F's and B's on `rank` (warm-up forwards, one forward and one backward, the remaining backwards)."""
    warmup = min(p - rank - 1, m)
    order = [Action(F, 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(F, 0, warmup + i), Action(B, 0, i)]
    return order + [Action(B, 0, i) for i in range(m - warmup, m)]


def _ready(a, rank, p, done, t, combined=False):
    """Whether action a of `rank` (one chunk per rank: stage = rank) may start at time t (what it waits for
    has finished by then; combined: a stage's input gradient leaves after its weight gradients, 1F1B's)."""
    if a.op == F:
        need = None if rank == 0 else (rank - 1, Action(F, 0, a.mb))
    elif a.op == B:
        need = (rank, Action(F, 0, a.mb)) if rank == p - 1 else (rank + 1, Action(W if combined else B, 0, a.mb))
    else:
        need = (rank, Action(B, 0, a.mb))
    return need is None or (need in done and done[need] <= t)


def _simulate(p, m, defer):
    """Per rank, 1F1B's F/B order with each W placed as `defer` says (False: right after its B); unit costs."""
    orders = [one_f_one_b_order(p, m, r) for r in range(p)]
    nxt, owed, free = [0] * p, [[] for _ in range(p)], [0.0] * p
    actions, done = [[] for _ in range(p)], {}
    started = [0] * p  # forwards started minus weight gradients done: micro-batches alive

    def run(r, a, t):
        actions[r].append(a)
        done[(r, a)] = free[r] = t + 1
        if a.op == F:
            started[r] += 1
        elif a.op == B:
            owed[r].append(Action(W, 0, a.mb))
        else:
            started[r] -= 1
    t = 0.0
    while any(nxt[r] < 2 * m or owed[r] for r in range(p)):
        progressed = False
        for r in range(p):
            if free[r] > t:
                continue
            a = orders[r][nxt[r]] if nxt[r] < 2 * m else None
            if owed[r] and (not defer or a is None or (a.op == F and started[r] >= p)):
                run(r, owed[r].pop(0), t)
            elif a is not None and _ready(a, r, p, done, t, combined=not defer):
                nxt[r] += 1
                run(r, a, t)
            elif owed[r]:  # it would wait: a W fills the hole
                run(r, owed[r].pop(0), t)
            else:
                continue
            progressed = True
        if not progressed:
            later = [f for f in list(free) + list(done.values()) if f > t]
            if not later:
                raise PlanError(f"the {p}-stage simulation stalls at time {t}")
            t = min(later)
    return Plan(tuple(tuple(a) for a in actions), done, max(done.values()))


@functools.lru_cache(maxsize=256)
def make_plan(schedule, p, m):
    """The Plan of `schedule` (1f1b | zb-h1) for p stages and m micro-batches, checked (check_plan)."""
    if schedule not in ("1f1b", "zb-h1"):
        raise ValueError(f"no plan for schedule {schedule!r}")
    plan = _simulate(p, m, defer=schedule == "zb-h1")
    check_plan(plan.actions, m)
    return plan


def _messages(actions, p):
    """Per directed rank pair, the messages in the sender's order and in the receiver's ((kind, stage, mb))."""
    sent, received = {}, {}
    for r, acts in enumerate(actions):
        for a in acts:
            if a.op == F and r + 1 < p:
                sent.setdefault((r, r + 1), []).append(("activation", r + 1, a.mb))
            if a.op == F and r > 0:
                received.setdefault((r - 1, r), []).append(("activation", r, a.mb))
            if a.op == B and r > 0:
                sent.setdefault((r, r - 1), []).append(("gradient", r - 1, a.mb))
            if a.op == B and r + 1 < p:
                received.setdefault((r + 1, r), []).append(("gradient", r, a.mb))
    return sent, received


def check_plan(actions, m):
    """PlanError naming the rank and action where a plan (per rank, its Actions; one chunk per rank) cannot run."""
    p = len(actions)
    for r, acts in enumerate(actions):
        seen = {}
        for k, a in enumerate(acts):
            if (a.op, a.mb) in seen:
                raise PlanError(f"rank {r} runs {a} twice")
            before = {F: None, B: F, W: B}[a.op]
            if before is not None and (before, a.mb) not in seen:
                raise PlanError(f"rank {r} runs {a} before its {before}")
            same = [b.mb for b in acts[:k] if b.op == a.op and b.chunk == a.chunk]
            if same and same[-1] > a.mb:
                raise PlanError(f"rank {r} runs {a} after {a.op}{same[-1]}: each chunk's {a.op}'s in micro-batch "
                                "order")
            seen[(a.op, a.mb)] = k
        missing = [f"{op}{i}" for op in (F, B, W) for i in range(m) if (op, i) not in seen]
        if missing:
            raise PlanError(f"rank {r} never runs {', '.join(missing[:3])}")
    sent, received = _messages(actions, p)
    for pair in sorted(set(sent) | set(received)):
        if sent.get(pair, []) != received.get(pair, []):
            raise PlanError(f"rank {pair[1]} receives from rank {pair[0]} in another order than it sends: "
                            f"{received.get(pair, [])[:4]} vs {sent.get(pair, [])[:4]}")
    _check_no_waits_for_ever(actions, p)


def _check_no_waits_for_ever(actions, p):
    """Every rank runs its list in order, each action once what it waits for has run: all of them must run."""
    nxt, done = [0] * p, set()
    while True:
        moved = False
        for r in range(p):
            while nxt[r] < len(actions[r]) and _ready(actions[r][nxt[r]], r, p, {k: 0 for k in done}, 0):
                done.add((r, actions[r][nxt[r]]))
                nxt[r] += 1
                moved = True
        if not moved:
            break
    stuck = [(r, actions[r][nxt[r]]) for r in range(p) if nxt[r] < len(actions[r])]
    if stuck:
        r, a = stuck[0]
        raise PlanError(f"rank {r} waits for ever at {a}: what it needs is never sent (or waits for it in a circle)")
