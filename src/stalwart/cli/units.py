"""What people type for counts, sizes, bandwidths and durations (``7B``, ``80GB``, ``2GB/s``,
``24h``), and sizes shown back the same way. Pure string arithmetic for the CLI's options."""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_bandwidth", "parse_count", "parse_duration", "parse_size"]

_DECIMAL = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9, "T": 10**12, "P": 10**15}


# ----------------------------------------------------------------------- parsing


def _number(text: str, what: str, example: str) -> tuple[float, str]:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*", text)
    if not m:
        raise ValueError(f"{what} {text!r} is not a number with an optional unit (e.g. {example})")
    return float(m.group(1)), m.group(2)


def parse_count(text: str) -> int:
    """A parameter count: ``125M``, ``1.3B``, ``7b``, ``70B``, ``1T``, ``7e9``, ``350k``.

    Suffixes are decimal: K = 1e3, M = 1e6, B (or G) = 1e9, T = 1e12.
    """
    value, unit = _number(text, "parameter count", "125M, 1.3B, 7B or 7e9")
    factor = _DECIMAL.get(unit.upper())
    if factor is None or unit.upper() == "P":
        raise ValueError(
            f"parameter count {text!r}: unknown suffix {unit!r}; use K, M, B or T (e.g. 1.3B)"
        )
    count = round(value * factor)
    if count < 1:
        raise ValueError(f"parameter count {text!r} is less than one parameter")
    return count


def _prefix_factor(prefix: str, binary: str) -> int:
    p = prefix.upper()
    if binary:
        return 1 << (10 * "KMGTP".index(p) + 10)
    return 1 if not p else _DECIMAL[p]


def parse_size(text: str) -> int:
    """A size in bytes: ``80GB`` and ``80G`` are decimal (80e9), ``80GiB`` is binary (80 * 2**30),
    ``512B`` is bytes.

    A unit is required: a bare ``80`` is refused, since ``--gpu-mem 80`` means 80 GB
    to a person and would be 80 bytes to a parser (as ``parse_duration`` refuses ``24``).
    """
    value, unit = _number(text, "size", "80GB, 40GiB or 512MB")
    if not unit:
        raise ValueError(
            f"size {text!r} has no unit: give one, e.g. {text.strip()}GB or {text.strip()}GiB "
            f"(or {text.strip()}B for bytes)"
        )
    m = re.fullmatch(r"([KMGTP]?)(i?)B?", unit, flags=re.IGNORECASE)
    if m is None or (m.group(2) and not m.group(1)):
        raise ValueError(f"size {text!r}: unknown unit {unit!r}; use B, KB, MB, GB, TB or KiB..TiB")
    return round(value * _prefix_factor(m.group(1), m.group(2)))


def parse_bandwidth(text: str) -> float:
    """Bytes per second: ``2GB/s``, ``500MB/s``, ``1.5GiB/s``; ``10Gb/s`` or ``10Gbps`` are bits.

    An upper-case ``B`` means bytes, a lower-case ``b`` (or ``bit``) bits, as in
    network and disk data sheets. ``/s`` may be left out (``2GB``); so may the
    ``B`` (``2G/s`` is bytes). A bare number is refused, like a bare size.
    """
    value, unit = _number(text, "bandwidth", "2GB/s, 500MB/s or 10Gb/s")
    if not unit:
        raise ValueError(
            f"bandwidth {text!r} has no unit: give one, e.g. {text.strip()}GB/s or "
            f"{text.strip()}MB/s (or {text.strip()}B/s for bytes per second)"
        )
    body = unit.removesuffix("/s") if unit.endswith("/s") else unit.removesuffix("ps")
    m = re.fullmatch(r"([kKmMgGtTpP]?)(i?)(B|b|bit|)", body)
    if m is None or (m.group(2) and not m.group(1)):
        raise ValueError(
            f"bandwidth {text!r}: unknown unit {unit!r}; use bytes (2GB/s, 500MB/s, 1GiB/s) "
            "or bits (10Gb/s)"
        )
    bits = m.group(3) in ("b", "bit")
    rate = value * _prefix_factor(m.group(1), m.group(2)) / (8 if bits else 1)
    if rate <= 0:
        raise ValueError(f"bandwidth {text!r} must be positive")
    return rate


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """Seconds from ``90s``, ``30m``, ``24h``, ``1.5h``, ``7d``, ``1h30m``; a unit is required.

    A bare number is refused: ``--mtbf 24`` could mean hours or seconds.
    """
    parts = re.findall(r"([0-9]*\.?[0-9]+)\s*([a-z]+)", text.strip().lower())
    joined = "".join(f"{n}{u}" for n, u in parts)
    if not parts or joined != re.sub(r"\s+", "", text.strip().lower()):
        raise ValueError(
            f"duration {text!r}: give a number with a unit, e.g. 90s, 30m, 24h, 7d or 1h30m"
        )
    total = 0.0
    for number, unit in parts:
        if unit not in _DURATION_UNITS:
            raise ValueError(f"duration {text!r}: unknown unit {unit!r}; use s, m, h, d or w")
        total += float(number) * _DURATION_UNITS[unit]
    return total


def format_size(n: float | None) -> str:
    """Bytes in decimal units, as sizes are given on the command line (80GB is 80e9 bytes)."""
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 100 else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"
