"""The links of :mod:`triton_reshard.testing.cluster`: what one node's link is (:class:`Link`), the bytes
through it (:class:`LinkBytes`), and the parsing of rates, latencies and losses into links, each refusal a
one-line ``ValueError`` naming the value."""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_RATE_BPS = 100e9  # tbf's timer resolution makes higher rates meaningless here


@dataclass(frozen=True, slots=True)
class Link:
    """One node's link: ``rate_bps`` bits per second each way (None: unshaped), one-way ``latency_s`` added to
    the node's egress, and ``loss`` (a fraction, 0..0.5) of the node's egress packets dropped."""

    rate_bps: float | None = None
    latency_s: float = 0.0
    loss: float = 0.0


@dataclass(frozen=True, slots=True)
class LinkBytes:
    """Bytes through one node's interface: ``tx`` sent (the node's uplink), ``rx`` received (its downlink)."""

    tx: int
    rx: int
    tx_packets: int = 0
    rx_packets: int = 0

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.tx - other.tx, self.rx - other.rx, self.tx_packets - other.tx_packets,
                         self.rx_packets - other.rx_packets)

    def as_dict(self) -> dict:
        return {"tx": self.tx, "rx": self.rx, "tx_packets": self.tx_packets, "rx_packets": self.rx_packets}


_UNITS = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def parse_rate(rate) -> float | None:
    """Bits per second from ``"1gbit"``, ``"500mbit"``, ``"10Gbit"``, ``"2gbps"`` (bytes) or a number of bits
    per second; None stays None (unshaped). ``ValueError`` (one line, naming the value) otherwise."""
    if rate is None:
        return None
    if isinstance(rate, bool):
        raise ValueError(f"cluster: link rate {rate!r} is not a rate (e.g. '1gbit' or 1e9 bits/s)")
    if isinstance(rate, int | float):
        v = float(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(rate))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(f"cluster: link rate {rate!r} is not a rate (e.g. '1gbit', '500mbit' or 1e9 bits/s)")
        v = float(m.group(1)) * _UNITS[unit]
    if not (8e3 <= v <= MAX_RATE_BPS):
        raise ValueError(f"cluster: link rate {rate!r} = {v:g} bit/s is outside 8 kbit/s .. "
                         f"{MAX_RATE_BPS:g} bit/s")
    return v


def parse_seconds(value, what: str = "latency") -> float:
    """Seconds from ``"50us"``, ``"1ms"``, ``"0.2s"`` or a number of seconds (>= 0, <= 10 s)."""
    if isinstance(value, bool):
        raise ValueError(f"cluster: link {what} {value!r} is not a duration (e.g. '50us', '1ms' or 1e-3 s)")
    if isinstance(value, int | float):
        v = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(us|ms|s|)\s*", str(value))
        if not m:
            raise ValueError(f"cluster: link {what} {value!r} is not a duration (e.g. '50us', '1ms' or 1e-3 s)")
        v = float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0}[m.group(2)]
    if not (0.0 <= v <= 10.0):
        raise ValueError(f"cluster: link {what} {value!r} must be between 0 and 10 s")
    return v


def parse_loss(value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0.0 <= value <= 0.5):
        raise ValueError(f"cluster: link loss {value!r} must be a fraction between 0 and 0.5 (0.01 = 1 %)")
    return float(value)


def _per_node(value, nodes: int, what: str) -> list:
    if isinstance(value, list | tuple):
        if len(value) != nodes:
            raise ValueError(f"cluster: {len(value)} link {what}s given for {nodes} nodes")
        return list(value)
    return [value] * nodes


def make_links(nodes: int, rate=None, latency=0.0, loss=0.0) -> list[Link]:
    """Per node a :class:`Link` from scalars (every node the same) or lists of ``nodes`` values."""
    rates = [parse_rate(r) for r in _per_node(rate, nodes, "rate")]
    lats = [parse_seconds(x) for x in _per_node(latency, nodes, "latency")]
    losses = [parse_loss(x) for x in _per_node(loss, nodes, "loss")]
    return [Link(r, lt, ls) for r, lt, ls in zip(rates, lats, losses, strict=True)]
