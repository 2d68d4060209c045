"""Per-layer residency: which layers keep their whole KV on the GPU instead of going through a hot buffer.

A layer whose top-k barely repeats from one step to the next (DeepSeek-V3.2's layers 0-1 on code:
1.5% consecutive overlap, GVR) misses almost every lookup whatever the buffer; keeping its KV
resident costs `1 / num_layers` of the KV per layer and removes its misses. Two ways to choose:

- by configuration: `parse_resident_layers("0,1", num_layers)`;
- by measurement: `choose_resident_layers(hit_rates, budget=...)` on per-layer hit rates (the
  replay's or an engine's counters after a warm-up), the layers with the lowest hit rates below
  `below`, at most `budget` of them.

Both return sorted layer indices; bad input is one `InvalidInputError` line naming the value.
"""

from __future__ import annotations

from collections.abc import Sequence

from hisparse_core.errors import InvalidInputError


def parse_resident_layers(spec: str | Sequence[int], num_layers: int) -> tuple[int, ...]:
    """`"0,1"` or `[0, 1]` -> `(0, 1)`, every index in `[0, num_layers)`, no repeats; `""` -> `()`."""
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",")] if spec.strip() else []
        if "" in parts:  # `0,,1` or `0,`: a gap is a typo, not "no layer there" (the CLIs refuse it too)
            raise InvalidInputError(f"resident layers {spec!r} have an empty item; expected comma-separated "
                                    "layer indices, e.g. 0,1 ('' for none)")
        try:
            layers = [int(p) for p in parts]
        except ValueError:
            raise InvalidInputError(f"resident layers {spec!r}: expected comma-separated layer indices, e.g. 0,1") \
                from None
    else:
        try:
            layers = list(spec)
        except TypeError:
            raise InvalidInputError(f"resident layers {spec!r}: expected a sequence of layer indices or a "
                                    "comma-separated string, e.g. (0, 1) or '0,1' (() for none)") from None
        from hisparse_core.checks import as_index  # here: checks imports torch, this module does not

        ints = [as_index(x) for x in layers]      # a numpy integer or an integer tensor is one; a bool is not
        if any(x is None for x in ints):
            raise InvalidInputError(f"resident layers {layers!r}: expected ints")
        layers = [x for x in ints if x is not None]
    bad = [x for x in layers if not 0 <= x < num_layers]
    if bad:
        raise InvalidInputError(f"resident layers {bad} out of range: expected indices in [0, {num_layers})")
    if len(set(layers)) != len(layers):
        raise InvalidInputError(f"resident layers {layers} repeat a layer")
    return tuple(sorted(layers))


def choose_resident_layers(hit_rates: Sequence[float], *, budget: int, below: float = 0.5) -> tuple[int, ...]:
    """The layers to keep resident: of those whose measured hit rate is below `below`, the (at most)
    `budget` with the lowest (ties: the lower index). `hit_rates[i]` is layer i's hits per lookup."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise InvalidInputError(f"resident layer budget must be an int >= 0, got {budget!r}")
    bad = [(i, h) for i, h in enumerate(hit_rates) if not 0.0 <= h <= 1.0]
    if bad:
        raise InvalidInputError(f"layer hit rates must lie in [0, 1]; got {bad[:3]}")
    poor = sorted((h, i) for i, h in enumerate(hit_rates) if h < below)
    return tuple(sorted(i for _, i in poor[:budget]))
