"""CPU model of prefill_attention_sm90.cu's synchronisation: mbarrier phases, the K/V ring
and the consumers' ping-pong on named barriers, run under many random interleavings.

Agents: the producer warpgroup (its 128 threads' arrivals on a full barrier land when its
copies do: an asynchronous event at a random later time) and the two consumer warpgroups
(each warp's lane 0 arrives on the empty barriers: 4 per warpgroup). The programs below
transcribe the kernel's order of waits, arrivals and wgmma reads; the expressions they
model are asserted to be in the kernel source. Checked: every schedule terminates (no
deadlock), a stage is only read while it holds the whole tile the reader expects, it is
never rewritten while a read is in flight, and every barrier ends with no partial phase.
"""

from __future__ import annotations

import random

import pytest

from llmc.cuda.kernels import KernelConfig, source

SRC = source("prefill_sm90", KernelConfig("bfloat16", 128, 32, 8))


class MBarrier:
    """count arrivals complete a phase; try_wait(parity) is true once that phase is done."""

    def __init__(self, count: int) -> None:
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self, n: int = 1) -> None:
        assert self.pending >= n, "more arrivals than the phase expects"
        self.pending -= n
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def done(self, parity: int) -> bool:
        return (self.phase & 1) != parity


class NamedBarrier:
    """bar.sync / bar.arrive with 256 threads: two warpgroups of 128."""

    def __init__(self) -> None:
        self.arrived, self.generation = 0, 0

    def arrive(self) -> int:
        self.arrived += 128
        gen = self.generation
        if self.arrived == 256:
            self.arrived, self.generation = 0, self.generation + 1
        assert self.arrived <= 256
        return gen


class Model:
    def __init__(self, n_tiles: int, stages: int, rng: random.Random) -> None:
        self.n, self.S, self.rng = n_tiles, stages, rng
        self.q_full = MBarrier(128)
        self.full = {(m, s): MBarrier(128) for m in "KV" for s in range(stages)}
        self.empty = {(m, s): MBarrier(8) for m in "KV" for s in range(stages)}
        self.named = [NamedBarrier(), NamedBarrier()]
        self.stage = {(m, s): None for m in "KV" for s in range(stages)}  # tile held
        self.readers = {(m, s): 0 for m in "KV" for s in range(stages)}
        self.events: list = []  # copies in flight: (stage key, tile)

    # ---- the kernel's programs (generators yield a condition to wait for) -------------
    def producer(self):
        self.events.append(("Q", None))
        for t in range(self.n):
            st, ph = t % self.S, ((t // self.S) & 1) ^ 1  # const unsigned ph = ...
            for m in "KV":
                yield lambda m=m, st=st, ph=ph: self.empty[m, st].done(ph)
                assert self.readers[m, st] == 0, "stage rewritten while wgmma reads it"
                self.stage[m, st] = ("partial", t)
                self.events.append(((m, st), t))

    def consumer(self, cw: int):
        mine, other = self.named[cw], self.named[1 - cw]
        if cw == 1:
            other.arrive()
        yield lambda: self.q_full.done(0)

        def section(reads, arrive_other=True):
            gen = mine.arrive()  # bar.sync: wait for this generation to complete
            yield lambda: mine.generation > gen
            for m, st, t in reads:
                yield lambda m=m, st=st, t=t: self.full[m, st].done((t // self.S) & 1)
            for m, st, t in reads:  # wgmma issue: the stage must hold tile t, whole
                assert self.stage[m, st] == ("full", t), (m, st, t, self.stage[m, st])
                self.readers[m, st] += 1
            if arrive_other:
                other.arrive()
            for m, st, _ in reads:  # wgmma.wait, then lane 0 of each warp arrives
                yield lambda: True
                self.readers[m, st] -= 1
                self.empty[m, st].arrive(4)

        yield from section([("K", 0, 0)])
        for t in range(1, self.n):
            yield from section([("K", t % self.S, t), ("V", (t - 1) % self.S, t - 1)])
        last = self.n - 1
        yield from section([("V", last % self.S, last)], arrive_other=cw == 0)

    # ---- random scheduler ----------------------------------------------------------
    def run(self) -> None:
        agents = [self.producer(), self.consumer(0), self.consumer(1)]
        waiting = [next(a) for a in agents]
        live = [True] * 3
        while any(live) or self.events:
            ready = [i for i in range(3) if live[i] and waiting[i]()]
            if self.events and (not ready or self.rng.random() < 0.3):
                key, t = self.events.pop(self.rng.randrange(len(self.events)))
                if key == "Q":
                    self.q_full.arrive(128)
                else:
                    self.stage[key] = ("full", t)
                    self.full[key].arrive(128)
                continue
            assert ready, "deadlock: every agent waits and no copy is in flight"
            i = self.rng.choice(ready)
            try:
                waiting[i] = next(agents[i])
            except StopIteration:
                live[i] = False
        for b in [self.q_full, *self.full.values(), *self.empty.values()]:
            assert b.pending == b.count, "a barrier ended inside a phase"
        assert all(nb.arrived == 0 for nb in self.named), "a named barrier ended half-arrived"


def test_kernel_source_has_the_modelled_protocol():
    for text in (
        "const unsigned ph = ((t / STAGES) & 1) ^ 1;",
        "mbar_wait(KFULL(st), (t / STAGES) & 1);",
        "mbar_wait(VFULL(pst), ((t - 1) / STAGES) & 1);",
        "mbar_wait(VFULL(lst), ((n_tiles - 1) / STAGES) & 1);",
        "mbar_wait(QFULL, 0);",
        "mbar_wait(KFULL(0), 0);",
        "if (cw == 1) named_arrive(other_bar);",
        "if (cw == 0) named_arrive(other_bar);",
        "mbar_init(KFULL(s), 128);",
        "mbar_init(KEMPTY(s), 8);",
        "if (lane == 0) mbar_arrive(KEMPTY(st));",
        "if (lane == 0) mbar_arrive(VEMPTY(pst));",
        "if (lane == 0) mbar_arrive(VEMPTY(lst));",
        "mbar_arrive_copies(QFULL);",
        'asm volatile("bar.sync %0, 256;"',
        'asm volatile("bar.arrive %0, 256;"',
    ):
        assert text in SRC, text
    assert SRC.count("named_sync(my_bar);") == 3 and SRC.count("named_arrive(other_bar);") == 4


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("n_tiles", [1, 2, 3, 4, 5, 9])
def test_pipeline_never_deadlocks_or_races(stages, n_tiles):
    for seed in range(150):
        Model(n_tiles, stages, random.Random(seed * 31 + n_tiles)).run()


def test_the_model_catches_a_missing_wait():
    """A producer that skips the empty barriers rewrites stages under the readers."""
    failures = 0
    for seed in range(50):
        broken = Model(5, 2, random.Random(seed))
        real = broken.producer

        def skip_waits(real=real):
            for _ in real():
                yield lambda: True

        broken.producer = skip_waits
        try:
            broken.run()
        except AssertionError:
            failures += 1
    assert failures > 0


class RawRing:
    """One producer thread's fp8 raw ring (producer v2): cp.async groups, each completing at a
    random time, except that cp.async.wait_group N completes all but the newest N."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.pending: list[tuple[str, int, int]] = []  # (K|V, slot, tile), oldest first
        self.slot: dict[tuple[str, int], tuple[str, int] | None] = {
            (m, r): None for m in "KV" for r in range(2)
        }

    def copy(self, m: str, t: int) -> None:  # copy_raw_fp8 + cp_async_commit
        held = self.slot[m, t & 1]
        assert held is None or held == ("converted", t - 2), "raw slot overwritten unconverted"
        self.slot[m, t & 1] = ("copying", t)
        self.pending.append((m, t & 1, t))

    def land(self, n: int) -> None:
        while len(self.pending) > n:
            m, r, t = self.pending.pop(0)
            self.slot[m, r] = ("raw", t)

    def wait(self, n: int) -> None:  # cp_async_wait<n>
        self.land(self.rng.randrange(len(self.pending) + 1))  # some finished on their own
        self.land(n)

    def convert(self, m: str, t: int) -> None:  # convert_raw_fp8 reads its own groups
        assert self.slot[m, t & 1] == ("raw", t), (m, t, self.slot[m, t & 1])
        self.slot[m, t & 1] = ("converted", t)


def fp8_producer(n: int, ring: RawRing) -> None:
    """The kernel's fp8 producer loop (v2), as the copies and waits of one thread."""
    ring.copy("K", 0)
    ring.copy("V", 0)
    for t in range(n):
        more = t + 1 < n
        if more:
            ring.copy("K", t + 1)
            ring.copy("V", t + 1)
            ring.wait(3)
        else:
            ring.wait(1)
        ring.convert("K", t)
        ring.wait(2 if more else 0)
        ring.convert("V", t)
    assert not ring.pending


def test_kernel_source_has_the_modelled_raw_ring():
    for text in (
        "cp_async_wait<3>();  // K(t) landed",
        "cp_async_wait<1>();",
        "cp_async_wait<2>();  // V(t) landed",
        "cp_async_wait<0>();",
        "const unsigned raw = sR + (t & 1) * 2 * RAW_BYTES;",
        "const unsigned nxt = sR + ((t + 1) & 1) * 2 * RAW_BYTES;",
        "copy_raw_fp8(nxt + RAW_BYTES, vc, ent, bt, bs_shift, kt, kv_end, kvh, p);",
        "convert_raw_fp8(sV + st * TILE_BYTES, raw + RAW_BYTES, VFULL(st), p);",
    ):
        assert text in SRC, text
    assert SRC.count("cp_async_commit();") == 4


@pytest.mark.parametrize("n_tiles", [1, 2, 3, 4, 7])
def test_fp8_raw_ring_converts_only_landed_tiles(n_tiles):
    for seed in range(200):
        fp8_producer(n_tiles, RawRing(random.Random(seed)))


def test_the_raw_ring_model_catches_a_short_wait():
    """Waiting for all but 4 groups before converting K(t) reads a tile still in flight."""
    failures = 0
    for seed in range(50):
        ring = RawRing(random.Random(seed))
        real_wait = ring.wait
        ring.wait = lambda n, real_wait=real_wait: real_wait(n + 1)
        try:
            fp8_producer(4, ring)
        except AssertionError:
            failures += 1
    assert failures > 0
