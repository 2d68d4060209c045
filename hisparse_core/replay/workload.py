"""Synthetic requests for the replay engine: arrival steps, prompts with shared prefixes, decode length.

Requests are assigned round-robin to `prefix_groups` families; the first `shared_tokens` prompt
tokens of every member of a family are the same (a shared system prompt or document), the rest
is the request's own. Token ids and KV content keys follow from (family or request, position),
so equal prefixes hash equal in the coordinator and produce byte-identical KV rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hisparse_core.errors import InvalidInputError


@dataclass(frozen=True, slots=True)
class RequestSpec:
    request_id: str
    index: int
    arrival_step: int
    family: int                  # -1: no shared prefix
    prompt_tokens: int
    shared_tokens: int
    decode_tokens: int
    family_key: int
    own_key: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.decode_tokens

    def token_ids(self) -> list[int]:
        """Prompt and decode tokens (deterministic)."""
        pos = np.arange(self.total_tokens, dtype=np.int64)
        key = np.where(pos < self.shared_tokens, self.family_key, self.own_key)
        return ((pos * 2654435761 + key * 97531 + 7) % 151_000).tolist()

    def content_keys(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """`(key, first, last)` runs of content keys over positions `[start, end)`."""
        runs = []
        if start < min(end, self.shared_tokens):
            runs.append((self.family_key, start, min(end, self.shared_tokens)))
        if max(start, self.shared_tokens) < end:
            runs.append((self.own_key, max(start, self.shared_tokens), end))
        return runs


def make_workload(requests: int, prompt_tokens: int, decode_tokens: int, *, prefix_groups: int = 4,
                  shared_fraction: float = 0.5, arrival_every: int = 1) -> list[RequestSpec]:
    """`requests` requests, request i arriving at step `i * arrival_every` (0: all at once)."""
    if requests <= 0 or prompt_tokens <= 1 or decode_tokens <= 0:
        raise InvalidInputError(f"workload needs requests > 0, prompt > 1 token and decode > 0 tokens; got "
                                f"{requests}, {prompt_tokens}, {decode_tokens}")
    if prefix_groups < 0 or not 0.0 <= shared_fraction < 1.0 or arrival_every < 0:
        raise InvalidInputError(f"prefix groups must be >= 0, shared fraction in [0, 1), arrival interval >= 0; got "
                                f"{prefix_groups}, {shared_fraction}, {arrival_every}")
    shared = int(prompt_tokens * shared_fraction) if prefix_groups else 0
    out = []
    for i in range(requests):
        family = i % prefix_groups if prefix_groups else -1
        out.append(RequestSpec(
            request_id=f"req-{i}", index=i, arrival_step=i * arrival_every, family=family,
            prompt_tokens=prompt_tokens, shared_tokens=shared if family >= 0 else 0, decode_tokens=decode_tokens,
            family_key=max(family, 0) + 1, own_key=1000 + i))
    return out
