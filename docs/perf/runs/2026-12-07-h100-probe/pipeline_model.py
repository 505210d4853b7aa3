"""A model of ring_pipeline's control flow (nvfp4_ring.cuh) for many warps sharing one claims counter, checked over
random and adversarial interleavings: every item consumed once, slab by slab, in the order its producer started it;
no stage overwritten before it is consumed; every consumed slab's cp.async group complete under wait_group<D - 2>;
the counter zero after each launch. Run: python3 pipeline_model.py N SEED (N random launches)."""
import random, sys

class Fail(Exception):
    pass

def check(cond, msg):
    if not cond:
        raise Fail(msg)

class Launch:
    def __init__(self, D, slabs, W, items, claims_on, mem, lid):
        self.D, self.slabs, self.W, self.items, self.claims_on = D, slabs, W, items, claims_on
        self.mem, self.lid = mem, lid
        self.step = 0
        self.atomic_log = []      # (step, warp, word, old)
        self.reset_step = None
        self.consumed = {}        # item -> list of (warp, slab)
        self.finished = {}        # item -> count
        self.post_reset_touch = []

class Warp:
    def __init__(self, L, w0):
        self.L, self.w0 = L, w0
        self.prod_started = []    # producer's started items in order
        self.cons_items = []      # consumer's items in order (finished)
        # cp.async model
        self.groups = []          # committed groups: list of sets of (item, slab)
        self.open = set()
        self.slab_group = {}      # (item, slab) -> group index (assigned on commit)
        self.stage_state = {}     # stage -> [(item, slab), consumed]
        self.claimed_used = True
        self.done = False

    def atomic_add(self, word):
        L = self.L
        if L.reset_step is not None:
            L.post_reset_touch.append((L.step, self.w0, word))
        old = L.mem[word]
        L.mem[word] = (old + 1) & 0xffffffff
        L.atomic_log.append((L.step, self.w0, word, old))
        return old

    def run(self):
        L = self; L = self.L
        D, W, items, slabs = L.D, L.W, L.items, L.slabs
        claims = L.claims_on
        w0 = self.w0
        lead = True
        ahead = [None] * (D - 1)
        st = {'queued': 0, 'claimed': 0, 'p_item': w0, 'p_s': 0}

        def push(item):
            for i in range(D - 1):            # unrolled
                if i == st['queued']:
                    ahead[i] = item
            check(st['queued'] < D - 1, f"queue overflow warp {w0} queued={st['queued']}")
            st['queued'] += 1

        def pop():
            check(st['queued'] > 0, f"pop on empty queue warp {w0}")
            item = ahead[0]
            i = 0
            while i + 1 < D - 1:              # unrolled
                ahead[i] = ahead[i + 1]
                i += 1
            st['queued'] -= 1
            return item

        def ask():
            if claims and lead:
                yield 'atomic'
                check(self.claimed_used, f"warp {w0}: ask overwrote an unused claimed value")
                st['claimed'] = self.atomic_add(0)
                self.claimed_used = False

        def src(item):
            check(0 <= item < items, f"src out of range {item}")
            self.prod_started.append(item)

        def issue(stage, s):
            item = st['p_item']
            ss = self.stage_state.get(stage)
            check(ss is None or ss[1], f"warp {w0}: produce writes stage {stage} holding unconsumed slab {ss and ss[0]}")
            self.stage_state[stage] = [(item, s), False]
            self.open.add((item, s))

        def commit():
            g = len(self.groups)
            for k in self.open:
                self.slab_group[k] = g
            self.groups.append(self.open)
            self.open = set()

        if st['p_item'] < items:
            src(st['p_item'])
            yield from ask()

        def produce(stage):
            if st['p_item'] >= items:
                return
            if st['p_s'] == slabs:
                if claims:
                    check(not self.claimed_used, f"warp {w0}: claimed used twice / never asked")
                    self.claimed_used = True
                    st['p_item'] = W + st['claimed']   # (int) cast: values small here
                else:
                    st['p_item'] = st['p_item'] + W
                st['p_s'] = 0
                if st['p_item'] >= items:
                    return
                src(st['p_item'])
                yield from ask()
                push(st['p_item'])
            issue(stage, st['p_s'])
            st['p_s'] += 1

        for d in range(D - 1):
            yield from produce(d)
            commit()
        # start()
        self.started = True
        c_item, c_s, stage, fill = w0, 0, 0, D - 1
        guard = 0
        while c_item < items:
            yield 'iter'
            guard += 1
            check(guard < 100000, f"warp {w0}: loop does not terminate")
            # cp_async_wait<D-2> + syncwarp: groups complete = all but the D-2 most recent
            complete_upto = len(self.groups) - (D - 2)   # groups [0, complete_upto) complete
            yield from produce(fill)
            commit()
            fill = 0 if fill + 1 == D else fill + 1
            # consume(ring[stage], c_item, c_s)
            key = (c_item, c_s)
            check(key in self.slab_group, f"warp {w0}: consume {key} never issued/committed")
            check(self.slab_group[key] < complete_upto,
                  f"warp {w0}: consume {key} in group {self.slab_group[key]} not complete (complete<{complete_upto})")
            ss = self.stage_state.get(stage)
            check(ss is not None and ss[0] == key and not ss[1], f"warp {w0}: stage {stage} holds {ss}, consumer wants {key}")
            ss[1] = True
            L.consumed.setdefault(c_item, []).append((w0, c_s))
            stage = 0 if stage + 1 == D else stage + 1
            c_s += 1
            if c_s == slabs:
                # finish(c_item)
                check(len(L.consumed[c_item]) == slabs, f"finish {c_item} before all slabs")
                L.finished[c_item] = L.finished.get(c_item, 0) + 1
                self.cons_items.append(c_item)
                c_s = 0
                c_item = pop() if st['queued'] else items
        check(st['queued'] == 0, f"warp {w0}: queue not empty at end ({st['queued']})")
        check(not self.open, "uncommitted copies at end")
        if claims:
            check(self.claimed_used, f"warp {w0}: last claim never consumed")
        # all slabs issued were consumed
        for stg, ss in self.stage_state.items():
            check(ss[1], f"warp {w0}: slab {ss[0]} issued but never consumed")
        if claims:
            # syncwarp, lead: threadfence, atomicAdd(claims+1)
            yield 'atomic'
            if self.atomic_add(1) == (W - 1) & 0xffffffff:
                L.mem[0] = 0
                L.mem[1] = 0
                check(L.reset_step is None, "double reset")
                L.reset_step = L.step
        self.done = True


def run_launch(D, slabs, W, items, claims_on, mem, lid, sched, rng):
    L = Launch(D, slabs, W, items, claims_on, mem, lid)
    warps = [Warp(L, w) for w in range(W)]
    gens = {w: warps[w].run() for w in range(W)}
    runnable = list(range(W))
    order = list(range(W))
    if sched == 'reverse_seq':
        order = order[::-1]
    elif sched == 'shuffle_seq':
        rng.shuffle(order)
    rr = 0
    fast = rng.randrange(W) if W else 0
    weights = [rng.random() ** 3 + 1e-3 for _ in range(W)]
    while runnable:
        if sched in ('seq', 'reverse_seq', 'shuffle_seq'):
            w = next(x for x in order if x in gens)
        elif sched == 'rr':
            w = runnable[rr % len(runnable)]; rr += 1
        elif sched == 'fast':
            w = fast if fast in gens and rng.random() < 0.9 else rng.choice(runnable)
        elif sched == 'weighted':
            w = rng.choices(runnable, [weights[x] for x in runnable])[0]
        elif sched == 'lastslow':   # one warp starved until everyone else is done
            others = [x for x in runnable if x != fast]
            w = rng.choice(others) if others else fast
        else:
            w = rng.choice(runnable)
        L.step += 1
        try:
            next(gens[w])
        except StopIteration:
            del gens[w]
            runnable.remove(w)
    # post-launch checks
    for it in range(items):
        c = L.consumed.get(it)
        check(c is not None, f"item {it} never consumed")
        check(len({x[0] for x in c}) == 1, f"item {it} consumed by several warps {c}")
        check([x[1] for x in c] == list(range(slabs)), f"item {it} slabs {c}")
        check(L.finished.get(it) == 1, f"item {it} finished {L.finished.get(it)} times")
    check(set(L.consumed) <= set(range(items)), "out of range item consumed")
    for wp in warps:
        check(wp.cons_items == wp.prod_started, f"warp {wp.w0}: consumer {wp.cons_items} != producer {wp.prod_started}")
        if not claims_on:
            check(wp.cons_items == list(range(wp.w0, items, W)), f"warp {wp.w0} stride items {wp.cons_items}")
    if claims_on:
        check(mem == [0, 0], f"counter not zero after launch: {mem}")
        check(L.reset_step is not None, "no reset")
        check(all(s <= L.reset_step for s, *_ in L.atomic_log), "atomic after reset")
        check(not L.post_reset_touch, f"touch after reset {L.post_reset_touch}")
    else:
        check(not L.atomic_log, "atomics without claims")
    return L

SCHEDS = ['random', 'seq', 'reverse_seq', 'shuffle_seq', 'rr', 'fast', 'weighted', 'lastslow']

def main(n, seed):
    rng = random.Random(seed)
    stats = {}
    for trial in range(n):
        mem = [0, 0]
        nl = rng.randint(1, 4)
        cfgs = []
        for lid in range(nl):
            D = rng.randint(2, 4); slabs = rng.randint(1, 5); W = rng.randint(1, 40)
            items = rng.choice([rng.randint(0, 300), rng.randint(0, W + 3), rng.randint(0, 3 * W)])
            claims_on = rng.random() < 0.7
            sched = rng.choice(SCHEDS)
            cfg = (D, slabs, W, items, claims_on, sched)
            cfgs.append(cfg)
            try:
                run_launch(D, slabs, W, items, claims_on, mem, lid, sched, random.Random(rng.random()))
            except Fail as e:
                print("FAIL trial", trial, "launch", lid, cfg, "history", cfgs, ":", e)
                return False
            stats[sched] = stats.get(sched, 0) + 1
    print("ok", n, "trials; launches per schedule:", stats)
    return True

if __name__ == '__main__':
    main(int(sys.argv[1]), int(sys.argv[2]))
