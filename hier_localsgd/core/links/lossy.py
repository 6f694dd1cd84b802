"""Lossy-link and WAN emulation for one level's process group (no kernel ``netem`` needed).

A level's payload collectives (model-sized all-reduces and broadcasts; control traffic
stays reliable, as it would over a retransmitting transport) are cut into packets of
``payload_bytes`` (default 1472 = a 1500-byte MTU minus IPv4 and UDP headers, i.e. 368
fp32 values) and each packet is lost or delivered according to a loss model:

* ``bernoulli`` — every packet is lost independently with probability ``p``;
* ``gilbert_elliott`` — a two-state Markov chain advancing *per packet* (not per call):
  good → bad with probability ``p``, bad → good with ``r``; a packet is lost with
  probability ``1 - k`` in the good state and ``1 - h`` in the bad state. netem's
  ``loss gemodel p r 1-h 1-k`` (percentages) is accepted too.

Stationary loss rate and mean burst length follow from the parameters
(:meth:`LossModel.loss_rate`, :meth:`LossModel.mean_burst`): with π_B = p/(p+r),
loss = ((1-k)·r + (1-h)·p)/(p+r), and mean burst = P(loss) / P(a loss preceded by a
delivery), which is 1/r for k = 1, h = 0 and 1/(1-p) for Bernoulli.

What a lost packet becomes (``fill``):

* ``zero`` — it adds nothing to the reduction;
* ``stale`` — the receiver uses its own value from before the collective instead;
* ``rescale`` — zero, then each packet's sum is rescaled to all contributors:
  ``sum_arrived · n / arrived`` (the average over the contributions that arrived, once
  the caller divides by n); a packet no contribution of which arrived stays zero, so
  every receiver computes the same result.

Where loss applies (``where``):

* ``per_sender`` — a sender's packet is lost for every receiver alike, so with ``zero``
  and ``rescale`` all replicas stay identical. Emulated with the real all-reduce on
  zeroed packets plus a small all-reduce of per-packet arrival counts.
* ``per_receiver`` — each receiver loses each sender's packets independently, so
  receivers disagree (as do ``stale`` fills in either mode). Emulated with an all-gather
  of contributions, reduced locally. The consistency guard (guard.py) detects the
  divergence at the next round and resyncs.

Randomness: one persistent numpy generator per stream, seeded once from (``seed``,
level, sender, receiver) — independent per rank and per level, never reseeded per call
(a fixed reseed would drop the same packets on every call). Given the seed and the
sequence of collectives, the losses are deterministic.

Timing: a collective on an emulated link takes at least its analytical bound — ring
all-reduce ``2(n-1)/n · S/B + 2(n-1)·α``, broadcast ``(n-1)·S/B + α``, all-gather
``(n-1)·S/B + (n-1)·α`` — by sleeping for whatever the real collective left over.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np

from hier_localsgd import costs

if TYPE_CHECKING:  # torch is imported where it is used: the configuration imports this module (core/runtime/choices.py)
    import torch

LOSS_MODELS = ("none", "bernoulli", "gilbert_elliott")
FILLS = ("zero", "stale", "rescale")
WHERE = ("per_sender", "per_receiver")
_LEVEL_CODES = {"inner": 1, "outer": 2, "flat": 3, "ddp": 4,
                # tensor parallelism (tp.py): one stream family per operation and direction
                "tp_attn_fwd": 11, "tp_attn_bwd": 12, "tp_mlp_fwd": 13, "tp_mlp_bwd": 14}


@dataclass(frozen=True)
class LossModel:
    """A packet loss process. ``kind`` none/bernoulli/gilbert_elliott; see module docstring."""

    kind: str = "none"
    p: float = 0.0  # bernoulli: loss probability; GE: P(good -> bad)
    r: float = 1.0  # GE: P(bad -> good)
    k: float = 1.0  # GE: P(delivered | good)
    h: float = 0.0  # GE: P(delivered | bad)

    def validate(self, path: str) -> None:
        if self.kind not in LOSS_MODELS:
            raise ValueError(f"{path}.loss: unknown loss model {self.kind!r} (expected one of {LOSS_MODELS})")
        for name in ("p", "r", "k", "h"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{path}.{name}: {v} — a probability must be in [0, 1]")
        if self.kind == "gilbert_elliott" and self.p + self.r == 0:
            raise ValueError(f"{path}: gilbert_elliott needs p + r > 0 (the chain never moves)")

    @property
    def enabled(self) -> bool:
        return self.kind != "none" and self.loss_rate() > 0

    def _pi_bad(self) -> float:
        return self.p / (self.p + self.r)

    def loss_rate(self) -> float:
        """Stationary probability that a packet is lost."""
        if self.kind == "none":
            return 0.0
        if self.kind == "bernoulli":
            return self.p
        pb = self._pi_bad()
        return (1 - pb) * (1 - self.k) + pb * (1 - self.h)

    def mean_burst(self) -> float:
        """Stationary mean length of a run of consecutive lost packets (inf if all are lost)."""
        loss = self.loss_rate()
        if loss == 0:
            return 0.0
        if self.kind == "bernoulli":
            return math.inf if self.p >= 1 else 1.0 / (1.0 - self.p)
        pb = self._pi_bad()
        pi = {"G": 1 - pb, "B": pb}
        lost = {"G": 1 - self.k, "B": 1 - self.h}
        trans = {("G", "G"): 1 - self.p, ("G", "B"): self.p, ("B", "G"): self.r, ("B", "B"): 1 - self.r}
        # P(packet t lost and packet t-1 delivered), stationary
        starts = sum(pi[a] * trans[(a, b)] * (1 - lost[a]) * lost[b] for a in "GB" for b in "GB")
        return math.inf if starts == 0 else loss / starts


def parse_netem(spec: str, path: str) -> LossModel:
    """Parses netem's ``loss P%`` / ``loss random P%`` / ``loss gemodel p r [1-h [1-k]]`` (percent)."""
    words = spec.replace("%", " ").split()
    if words[:1] == ["loss"]:
        words = words[1:]
    try:
        if words and words[0] == "gemodel":
            vals = [float(x) / 100 for x in words[1:]]
            if not 1 <= len(vals) <= 4:
                raise ValueError
            p = vals[0]
            r = vals[1] if len(vals) > 1 else 1 - p  # netem: r defaults to 1 - p
            one_minus_h = vals[2] if len(vals) > 2 else 1.0
            one_minus_k = vals[3] if len(vals) > 3 else 0.0
            return LossModel("gilbert_elliott", p=p, r=r, k=1 - one_minus_k, h=1 - one_minus_h)
        if words and words[0] == "random":
            words = words[1:]
        if len(words) == 1:
            return LossModel("bernoulli", p=float(words[0]) / 100)
    except ValueError:
        pass
    raise ValueError(f"{path}.netem: cannot parse {spec!r} (expected 'loss 5%' or 'loss gemodel p r 1-h 1-k' in percent)")


class LossStream:
    """One sender's (or one sender-receiver pair's) packet fates, across calls."""

    def __init__(self, model: LossModel, seed_words: Tuple[int, ...]) -> None:
        self.model = model
        self.rng = np.random.default_rng(np.random.SeedSequence(list(seed_words)))
        self.bad = bool(self.rng.random() < (model._pi_bad() if model.kind == "gilbert_elliott" else 0.0))
        self.open_burst = 0  # a burst still running at the end of the last call
        self.bursts: Counter = Counter()  # burst length -> count (closed bursts)
        self.sent = 0
        self.lost = 0

    def sample(self, n: int) -> np.ndarray:
        """Fates of the next ``n`` packets: True = lost."""
        m = self.model
        if n == 0 or not m.enabled:
            lost = np.zeros(n, dtype=bool)
        elif m.kind == "bernoulli":
            lost = self.rng.random(n) < m.p
        else:
            lost = self.rng.random(n) < np.where(self._states(n), 1.0 - m.h, 1.0 - m.k)
        self._account(lost)
        return lost

    def _states(self, n: int) -> np.ndarray:
        """Per-packet bad-state flags. Run lengths are geometric; the chain is memoryless,
        so only the current state carries over between calls."""
        m = self.model
        out = np.empty(n, dtype=bool)
        pos, bad = 0, self.bad
        # packets left in the current state: geometric, >= 0, since the chain may leave now
        stay = self.rng.geometric(m.r if bad else m.p) - 1 if (m.r if bad else m.p) > 0 else n
        while pos < n:
            run = min(n - pos, int(stay))
            out[pos : pos + run] = bad
            pos += run
            if pos >= n:
                break
            bad = not bad
            leave = m.r if bad else m.p
            stay = self.rng.geometric(leave) if leave > 0 else n  # >= 1 packet in the new state
        # the state of the last packet is where the next call starts
        self.bad = bool(out[-1]) if n else bad
        return out

    def _account(self, lost: np.ndarray) -> None:
        n = len(lost)
        self.sent += n
        k = int(lost.sum())
        self.lost += k
        if n == 0:
            return
        if k == 0:
            if self.open_burst:
                self.bursts[self.open_burst] += 1
                self.open_burst = 0
            return
        # run-length encode the lost runs
        padded = np.concatenate(([False], lost, [False]))
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        starts, ends = edges[0::2], edges[1::2]
        lengths = (ends - starts).tolist()
        if self.open_burst:
            if starts[0] == 0:
                lengths[0] += self.open_burst
            else:
                self.bursts[self.open_burst] += 1
            self.open_burst = 0
        if ends[-1] == n:  # still open at the end of this call
            self.open_burst = lengths.pop()
        for length in lengths:
            self.bursts[length] += 1


@dataclass(frozen=True)
class LinkSpec:
    """One level's emulated link (the ``links.<level>`` config section, validated)."""

    model: LossModel = field(default_factory=LossModel)
    fill: str = "zero"
    where: str = "per_sender"
    payload_bytes: int = 1472
    latency_s: float = 0.0  # one way, per hop (α)
    bandwidth_Bps: float = 0.0  # bytes/s; 0 = not emulated
    seed: int = 0

    @property
    def emulates_time(self) -> bool:
        return self.latency_s > 0 or self.bandwidth_Bps > 0

    @property
    def active(self) -> bool:
        return self.model.enabled or self.emulates_time

    def validate(self, path: str) -> None:
        self.model.validate(path)
        if self.fill not in FILLS:
            raise ValueError(f"{path}.fill: unknown fill {self.fill!r} (expected one of {FILLS})")
        if self.where not in WHERE:
            raise ValueError(f"{path}.where: {self.where!r} — expected one of {WHERE}")
        if self.payload_bytes < 4:
            raise ValueError(f"{path}.payload_bytes: {self.payload_bytes} — must hold at least one value")
        if self.latency_s < 0:
            raise ValueError(f"{path}.latency_ms: must be at least 0")
        if self.bandwidth_Bps < 0:
            raise ValueError(f"{path}.bandwidth_gbps: {self.bandwidth_Bps * 8 / 1e9} — must be at least 0 (0: not emulated)")

    # The bounds the emulation sleeps up to (hier_localsgd/costs.py).
    def allreduce_time(self, nbytes: int, n: int) -> float:
        return costs.allreduce_time(nbytes, n, self.latency_s, self.bandwidth_Bps)

    def broadcast_time(self, nbytes: int, n: int) -> float:
        return costs.broadcast_time(nbytes, n, self.latency_s, self.bandwidth_Bps)

    def allgather_time(self, nbytes: int, n: int) -> float:
        return costs.allgather_time(nbytes, n, self.latency_s, self.bandwidth_Bps)


class LinkEmulation:
    """The lossy/slow behaviour of one level's links in this process, with statistics."""

    def __init__(self, spec: LinkSpec, level: str) -> None:
        self.spec = spec
        self.level = level
        self._streams: Dict[Tuple[int, int], LossStream] = {}
        self.emulated_delay_s = 0.0  # time added by sleeping
        self.emulated_time_s = 0.0  # sum of the analytical bounds
        self.payload_bytes_sent = 0
        self.collectives = 0

    # -- streams ----------------------------------------------------------------
    def stream(self, sender: int, receiver: int = -1) -> LossStream:
        key = (sender, receiver)
        st = self._streams.get(key)
        if st is None:
            words = (self.spec.seed, _LEVEL_CODES.get(self.level, 9), sender, receiver + 1)
            st = self._streams[key] = LossStream(self.spec.model, words)
        return st

    def packets(self, numel: int, element_size: int) -> Tuple[int, int]:
        """(values per packet, number of packets) for a tensor of ``numel`` values."""
        per = max(1, self.spec.payload_bytes // element_size)
        return per, (numel + per - 1) // per

    # -- timing -------------------------------------------------------------------
    def pad(self, started: float, bound_s: float) -> None:
        """Sleeps until ``bound_s`` after ``started`` (the collective's emulated duration)."""
        self.emulated_time_s += bound_s
        left = started + bound_s - time.time()
        if left > 0:
            self.emulated_delay_s += left
            time.sleep(left)

    # -- reductions ----------------------------------------------------------------
    # Tensors are handled as a (packets x values) view, plus a short last packet, so
    # masks never expand to the tensor's size and only affected packets are touched.

    @staticmethod
    def packet_rows(t: torch.Tensor, per: int) -> List[Tuple[torch.Tensor, slice]]:
        """``t`` as (packets x ``per`` values) views: the full packets, then a short last
        one; each with its slice of the per-packet flags."""
        flat = t.view(-1)
        full = flat.numel() // per
        parts = [(flat[: full * per].view(full, per), slice(0, full))]
        if flat.numel() > full * per:
            parts.append((flat[full * per :].view(1, -1), slice(full, full + 1)))
        return parts

    def zero_packets(self, t: torch.Tensor, lost: torch.Tensor, per: int) -> None:
        """Zeroes the packets of ``t`` flagged in ``lost`` (one flag per packet, on any
        device: the indices move to ``t``'s, as index_fill_ needs)."""
        for rows, sl in self.packet_rows(t, per):
            idx = lost[sl].nonzero().view(-1).to(rows.device)
            if idx.numel():
                rows.index_fill_(0, idx, 0)

    def save_rows(self, t: torch.Tensor, arrived: torch.Tensor, n: int, per: int) -> List[torch.Tensor]:
        """Copies of the packets that will miss a contribution (what a stale fill needs)."""
        if self.spec.fill != "stale":
            return []
        return [rows.index_select(0, ((n - arrived[sl]) > 0).nonzero().view(-1).to(rows.device)) for rows, sl in self.packet_rows(t, per)]

    def fill_per_sender(self, result: torch.Tensor, arrived: torch.Tensor, n: int, per: int, saved: List[torch.Tensor]) -> None:
        """``result`` holds the sum of arrived contributions; ``arrived`` the per-packet
        counts; ``saved`` this receiver's own values of the packets that missed some
        (from :meth:`save_rows`, taken before the collective)."""
        fill = self.spec.fill
        if fill == "zero":
            return
        for i, (rows, sl) in enumerate(self.packet_rows(result, per)):
            a = arrived[sl]  # on any device: the indices and counts move to ``result``'s
            hit = (n - a) > 0 if fill == "stale" else ((n - a) > 0) & (a > 0)
            found = hit.nonzero().view(-1)
            if not found.numel():
                continue
            ah = a[found].to(device=rows.device, dtype=rows.dtype)[:, None]
            idx = found.to(rows.device)
            sub = rows.index_select(0, idx)
            if fill == "stale":
                # saved[i] holds this receiver's values of the rows that missed some
                sub += (n - ah) * saved[i]
            else:  # rescale to n contributions (a packet nobody delivered stays zero)
                sub *= n / ah
            rows.index_copy_(0, idx, sub)

    def reduce_per_receiver(self, parts: List[torch.Tensor], me: int, ids: List[int], out: torch.Tensor) -> None:
        """Sums ``parts`` (one per sender) as receiver ``me`` sees them, into ``out``."""
        import torch

        n = len(parts)
        per, npk = self.packets(out.numel(), out.element_size())
        dev = out.device  # masks: sampled on the host per collective, used on the tensor's device
        lost = {j: torch.from_numpy(self.stream(ids[j], ids[me]).sample(npk)).to(dev) for j in range(n) if j != me}
        arrived = n - sum(m.to(torch.int64) for m in lost.values()) if lost else torch.full((npk,), n, device=dev)
        saved = self.save_rows(parts[me], arrived, n, per)
        total = parts[me].clone()
        for j, m in lost.items():
            self.zero_packets(parts[j], m, per)
            total.add_(parts[j])
        self.fill_per_sender(total, arrived, n, per, saved)
        out.copy_(total)

    # -- statistics ----------------------------------------------------------------
    def stats(self) -> Dict[str, object]:
        sent = sum(s.sent for s in self._streams.values())
        lost = sum(s.lost for s in self._streams.values())
        hist: Counter = Counter()
        for s in self._streams.values():
            hist.update(s.bursts)
            if s.open_burst:
                hist[s.open_burst] += 1
        n_bursts = sum(hist.values())
        m = self.spec.model
        return {
            "model": m.kind,
            "fill": self.spec.fill,
            "where": self.spec.where,
            "expected_loss_rate": m.loss_rate(),
            "expected_mean_burst": m.mean_burst(),
            "packets_sent": sent,
            "packets_lost": lost,
            "observed_loss_rate": lost / sent if sent else None,
            "observed_mean_burst": (sum(k * v for k, v in hist.items()) / n_bursts) if n_bursts else None,
            "burst_histogram": {str(k): v for k, v in sorted(hist.items())},
            "payload_bytes_sent": self.payload_bytes_sent,
            "emulated_time_s": self.emulated_time_s,
            "emulated_delay_s": self.emulated_delay_s,
            "collectives": self.collectives,
        }


@dataclass
class LinkConfig:
    """One level's emulated link: the ``links.<level>`` section. Defaults: reliable, unthrottled."""

    loss: str = "none"  # none | bernoulli | gilbert_elliott
    p: float = 0.0  # bernoulli: loss probability; gilbert_elliott: P(good -> bad)
    r: float = 1.0  # gilbert_elliott: P(bad -> good)
    k: float = 1.0  # gilbert_elliott: P(delivered | good)
    h: float = 0.0  # gilbert_elliott: P(delivered | bad)
    netem: str = ""  # alternatively netem syntax: "loss 5%" or "loss gemodel p r 1-h 1-k" (percent)
    fill: str = "zero"  # zero | stale | rescale
    where: str = "per_sender"  # per_sender | per_receiver
    payload_bytes: int = 1472
    latency_ms: float = 0.0  # one way
    bandwidth_gbps: float = 0.0  # 0: not emulated
    seed: int = 0

    def spec(self, path: str) -> LinkSpec:
        """Builds and validates the :class:`LinkSpec`; raises ValueError naming a field under ``path``."""
        model = parse_netem(self.netem, path) if self.netem else LossModel(self.loss, p=self.p, r=self.r, k=self.k, h=self.h)
        spec = LinkSpec(
            model=model, fill=self.fill, where=self.where, payload_bytes=self.payload_bytes,
            latency_s=self.latency_ms / 1000.0, bandwidth_Bps=costs.gbps_to_Bps(self.bandwidth_gbps), seed=self.seed,
        )
        if self.bandwidth_gbps < 0:
            raise ValueError(f"{path}.bandwidth_gbps: {self.bandwidth_gbps} — must be at least 0 (0: not emulated)")
        if self.latency_ms < 0:
            raise ValueError(f"{path}.latency_ms: {self.latency_ms} — must be at least 0")
        spec.validate(path)
        return spec


@dataclass
class LinksConfig:
    inner: LinkConfig = field(default_factory=LinkConfig)
    outer: LinkConfig = field(default_factory=LinkConfig)  # also the flat and ddp baselines' links


def check_sweep_grid(prefix: str, rates: List[float], models: List[str]) -> None:
    """A loss sweep's rates and models (``sweep.*``, ``tp_sweep.*``); raises ValueError naming
    the field, e.g. ``sweep.rates[2]``."""
    for i, r in enumerate(rates):
        if not 0 <= r < 1:
            raise ValueError(f"{prefix}.rates[{i}]: {r} — a loss rate must be in [0, 1)")
    for i, m in enumerate(models):
        if m not in ("bernoulli", "gilbert_elliott"):
            raise ValueError(f"{prefix}.models[{i}]: unknown loss model {m!r} (expected bernoulli or gilbert_elliott)")


def describe(spec: Optional[LinkSpec]) -> str:
    if spec is None or not spec.active:
        return "reliable, unthrottled"
    m = spec.model
    parts = []
    if m.enabled:
        parts.append(f"{m.kind} loss {m.loss_rate():.2%} (mean burst {m.mean_burst():.2f} packets), fill {spec.fill}, {spec.where}")
    if spec.latency_s:
        parts.append(f"latency {spec.latency_s * 1e3:g} ms")
    if spec.bandwidth_Bps:
        parts.append(f"bandwidth {spec.bandwidth_Bps * 8 / 1e9:g} Gbit/s")
    return ", ".join(parts)

