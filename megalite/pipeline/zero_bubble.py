"""Pipeline schedules as plans (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): per pipeline rank, the
list of its actions, F (a forward), B (a backward's input gradient, which the previous stage waits for) and W (its
weight gradients, which nobody waits for), each of one model chunk and micro-batch; the sends and receives follow
from them (an F's output goes to the next stage, a B's input gradient to the previous one).

A plan is made by simulating the pipeline with unit costs (F = B = W = 1): each rank keeps 1F1B's order of F's and
B's and fills a wait with a W it owes (a W it owes also goes first where one more F would keep more micro-batches
alive than 1F1B's first stage does, p), so ZB-H1's peak activation memory is 1F1B's (the paper's H1) and its bubble
(p - 1)(F + B - W) instead of (p - 1)(F + B + W); 1f1b's plan runs each W right after its B (and its
simulation sends the input gradient after both, as 1F1B's one backward does). zbv's plan runs two chunks per rank
placed in a V (megalite/parallel/pipeline_stages.py): a free rank runs a B whose gradient has come, else an F
whose input has come (the later chunk's first) while fewer than 2p chunk-activations are alive (1F1B's first
stage: p micro-batches of a p-th of the model; one kept free for the later chunk), else the oldest W it owes; at
p = 2 and 4 its step is the least any plan can take once m >= p, 6m + p - 1 (unit costs per chunk: only the
rank of the V's turning point waits, p - 1 units, for its first input). dualpipev's plan is DualPipe's fixed
order on the same V (dualpipe_v_order), timed with unit costs. check_plan proves a plan runs: every
(chunk, micro-batch) of a rank has one F, one B and one W in that order, each chunk's in micro-batch order; every
message a rank waits for is sent by the stage before or after (no rank waits for one never issued, no circle of
waits). A rank posts its receives from each peer in the order that peer sends them (zero_bubble_run.py), as NCCL,
which ignores tags, matches them."""

import dataclasses
import functools

from megalite.parallel.pipeline_stages import PipelineStages

F, B, W = "F", "B", "W"
SCHEDULES = ("1f1b", "zb-h1", "zbv", "dualpipev")


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
    stages: PipelineStages

    def idle_fraction(self, rank):
        busy = sum(1 for _ in self.actions[rank])  # (unit costs)
        return 1 - busy / self.makespan

    def most_alive(self, rank):
        """The most chunk-activations (a micro-batch's of one chunk) `rank` holds at once (from an F until its
        W)."""
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


def _needs(a, rank, st, combined=False):
    """(rank, Action) that action a of `rank` waits for (None: nothing), the stages placed as `st` says: an F the
    stage before's F, a B the stage after's B (the last stage: its own F), a W its B (combined: a stage's input
    gradient leaves after its weight gradients, 1F1B's)."""
    s = st.stage(rank, a.chunk)
    if a.op == F:
        if s == 0:
            return None
        r, c = st.holder(s - 1)
        return r, Action(F, c, a.mb)
    if a.op == B:
        if s == st.count - 1:
            return rank, Action(F, a.chunk, a.mb)
        r, c = st.holder(s + 1)
        return r, Action(W if combined else B, c, a.mb)
    return rank, Action(B, a.chunk, a.mb)


def _ready(a, rank, st, done, t, combined=False):
    """Whether action a of `rank` may start at time t (what it waits for has finished by then)."""
    need = _needs(a, rank, st, combined)
    return need is None or (need in done and done[need] <= t)


def _simulate(p, m, defer):
    """Per rank, 1F1B's F/B order with each W placed as `defer` says (False: right after its B); unit costs."""
    st = PipelineStages(p)
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
            elif a is not None and _ready(a, r, st, done, t, combined=not defer):
                nxt[r] += 1
                run(r, a, t)
            elif owed[r]:  # it would wait: a W fills the hole
                run(r, owed[r].pop(0), t)
            else:
                continue
            progressed = True
        if not progressed:
            t = _next_event(free, done, t, f"the {p}-stage simulation")
    return Plan(tuple(tuple(a) for a in actions), done, max(done.values()), st)


def _next_event(free, done, t, what):
    """The simulation's next time at which a rank frees or an action ends; PlanError if none (nothing can run)."""
    later = [f for f in list(free) + list(done.values()) if f > t]
    if not later:
        raise PlanError(f"{what} stalls at time {t}")
    return min(later)


def _simulate_v(p, m):
    """ZB-V's plan (two chunks per rank in a V), greedy on unit costs per chunk: see the module's docstring."""
    st, cap = PipelineStages(p, 2, "v"), 2 * p
    done, free, alive = {}, [0.0] * p, [0] * p
    fwd, bwd = [[0, 0] for _ in range(p)], [[0, 0] for _ in range(p)]  # per rank and chunk: the next F's, B's mb
    owed, actions = [[] for _ in range(p)], [[] for _ in range(p)]

    def pick(r, t):
        for c in (0, 1):
            if bwd[r][c] < m and _ready(a := Action(B, c, bwd[r][c]), r, st, done, t):
                return a
        for c in (1, 0):  # (a chunk-0 F leaves room for one of chunk 1, which brings its micro-batch nearer its B)
            if fwd[r][c] < m and alive[r] < cap - (c == 0) and _ready(a := Action(F, c, fwd[r][c]), r, st, done, t):
                return a
        return owed[r][0] if owed[r] else None
    t = 0.0
    while any(len(acts) < 6 * m for acts in actions):
        progressed = False
        for r in range(p):
            if free[r] > t or (a := pick(r, t)) is None:
                continue
            if a.op == F:
                fwd[r][a.chunk] += 1
                alive[r] += 1
            elif a.op == B:
                bwd[r][a.chunk] += 1
                owed[r].append(Action(W, a.chunk, a.mb))
            else:
                owed[r].pop(0)
                alive[r] -= 1
            actions[r].append(a)
            done[(r, a)] = free[r] = t + 1
            progressed = True
        if not progressed:
            t = _next_event(free, done, t, f"the {p}-rank V's simulation")
    return Plan(tuple(tuple(a) for a in actions), done, max(done.values()), st)


def dualpipe_v_order(p, m, rank):
    """DualPipeV's actions on `rank` (DeepSeek's DualPipe folded into a V, as Sea AI Lab's DualPipeV and
    torch.distributed.pipelining's ScheduleDualPipeV order them), the V as PipelineStages places it: rank r is
    d = p - 1 - r stages from the first, holding stage d (chunk 0, going down) and 2p - 1 - d (chunk 1, coming
    back). Its phases: chunk-0 forwards to fill the V; forwards of both chunks; a backward of chunk 1 with its W
    and a forward; the steady state, pairs of one chunk's forward and the other chunk's backward (each pair what
    DualPipe overlaps: its W right after its B); the drain, where the later half of the backwards defer their W
    into the bubble. Needs m >= 2p (a full V in flight)."""
    d, k = p - 1 - rank, rank  # (k: the stages after this rank's chunk 0 on the way down)
    acts, fwd, bwd, owed = [], [0, 0], [0, 0], []

    def f(c):
        acts.append(Action(F, c, fwd[c]))
        fwd[c] += 1

    def b(c, defer=False):
        acts.append(Action(B, c, bwd[c]))
        (owed if defer else acts).append(Action(W, c, bwd[c]))
        bwd[c] += 1

    def w():
        acts.append(owed.pop(0))
    for _ in range(2 * k):
        f(0)
    for _ in range(d + 1):
        f(0), f(1)
    for _ in range(k):
        b(1, defer=True), w(), f(1)
    for _ in range(m - 2 * p + d + 1):  # the steady state: F0 with B1, F1 with B0
        f(0), b(1), f(1), b(0)
    for _ in range(k):
        b(1), f(1), b(0)
    defer = False
    for i in range(d + 1):  # the drain: from its middle on (chunk 1's B first on odd d) each W waits
        defer = defer or (i == (d + 1) // 2 and d % 2 == 1)
        b(1, defer)
        defer = defer or (i == (d + 1) // 2 and d % 2 == 0)
        b(0, defer)
    for _ in range(k):
        w(), b(0, defer=True)
    while owed:
        w()
    return acts


def _timed(orders, st):
    """Plan of fixed per-rank orders, each action at unit cost once what it waits for has finished."""
    p, nxt, free, done = st.p, [0] * st.p, [0.0] * st.p, {}
    t = 0.0
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if free[r] <= t and nxt[r] < len(orders[r]) and _ready(a := orders[r][nxt[r]], r, st, done, t):
                done[(r, a)] = free[r] = t + 1
                nxt[r] += 1
                progressed = True
        if not progressed:
            t = _next_event(free, done, t, f"the {p}-rank plan")
    return Plan(tuple(tuple(o) for o in orders), done, max(done.values()), st)


@functools.lru_cache(maxsize=256)
def make_plan(schedule, p, m):
    """The Plan of `schedule` (1f1b | zb-h1 | zbv | dualpipev) for p pipeline ranks and m micro-batches, checked
    (check_plan)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"no plan for schedule {schedule!r}")
    if schedule == "dualpipev":
        if m < 2 * p:
            raise PlanError(f"DualPipeV over {p} ranks needs at least {2 * p} micro-batches, not {m}")
        plan = _timed([dualpipe_v_order(p, m, r) for r in range(p)], PipelineStages(p, 2, "v"))
    else:
        plan = _simulate_v(p, m) if schedule == "zbv" else _simulate(p, m, defer=schedule == "zb-h1")
    check_plan(plan.actions, m, plan.stages)
    return plan


def messages(actions, st):
    """Per directed pair of ranks, the messages in the sender's order ((kind, stage it is for, mb)), and the set
    each receiver waits for; none between two stages of one rank (the V's turning point)."""
    sent, received = {}, {}
    for r, acts in enumerate(actions):
        for a in acts:
            s = st.stage(r, a.chunk)
            if a.op not in (F, B):
                continue
            to, frm = (s + 1, s - 1) if a.op == F else (s - 1, s + 1)
            kind = "activation" if a.op == F else "gradient"
            if 0 <= to < st.count and (dst := st.holder(to)[0]) != r:
                sent.setdefault((r, dst), []).append((kind, to, a.mb))
            if 0 <= frm < st.count and (src := st.holder(frm)[0]) != r:
                received.setdefault((src, r), set()).add((kind, s, a.mb))
    return sent, received


def check_plan(actions, m, stages=None):
    """PlanError naming the rank and action where a plan (per rank, its Actions; stages: where they sit, default
    one chunk per rank) cannot run."""
    st = stages or PipelineStages(len(actions))
    for r, acts in enumerate(actions):
        seen, last_mb = {}, {}
        for k, a in enumerate(acts):
            key = (a.op, a.chunk, a.mb)
            if key in seen:
                raise PlanError(f"rank {r} runs {a} twice")
            before = {F: None, B: F, W: B}[a.op]
            if before is not None and (before, a.chunk, a.mb) not in seen:
                raise PlanError(f"rank {r} runs {a} before its {before}")
            if last_mb.get((a.op, a.chunk), -1) > a.mb:
                raise PlanError(f"rank {r} runs {a} after {Action(a.op, a.chunk, last_mb[(a.op, a.chunk)])}: each "
                                f"chunk's {a.op}'s in micro-batch order")
            seen[key], last_mb[(a.op, a.chunk)] = k, a.mb
        missing = [repr(Action(op, c, i)) for c in range(st.v) for op in (F, B, W) for i in range(m)
                   if (op, c, i) not in seen]
        if missing:
            raise PlanError(f"rank {r} never runs {', '.join(missing[:3])}")
    sent, received = messages(actions, st)
    for pair in sorted(set(sent) | set(received)):
        if sorted(sent.get(pair, [])) != sorted(received.get(pair, set())):
            raise PlanError(f"rank {pair[1]} waits for other messages from rank {pair[0]} than it sends")
    _check_no_waits_for_ever(actions, st)


def _check_no_waits_for_ever(actions, st):
    """Every rank runs its list in order, each action once what it waits for has run: all of them must run."""
    p = st.p
    nxt, done = [0] * p, {}  # (rank, Action) -> 0: ran
    while True:
        moved = False
        for r in range(p):
            while nxt[r] < len(actions[r]) and _ready(actions[r][nxt[r]], r, st, done, 0):
                done[(r, actions[r][nxt[r]])] = 0
                nxt[r] += 1
                moved = True
        if not moved:
            break
    stuck = [(r, actions[r][nxt[r]]) for r in range(p) if nxt[r] < len(actions[r])]
    if stuck:
        r, a = stuck[0]
        raise PlanError(f"rank {r} waits for ever at {a}: what it needs is never sent (or waits for it in a circle)")
