"""Shared prefill processes of the NIXL tests, spawned once per session (in parallel) on first use."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pd_peer import EngineSpec, PrefillPeer, start_peers

LAYERS, BS, PAGES = 3, 16, 48


@pytest.fixture(scope="session")
def prefill_peers() -> Iterator[dict[str, PrefillPeer]]:
    """`main` hosts engines `dense`, `strided` (padded page stride) and `epochs` (restarted by tests);
    `victim` hosts engine `victim` in a process the fault tests stop and kill."""
    from hisparse_core.pd.nixl_transport import nixl_available

    reason = nixl_available()
    if reason is not None:
        pytest.skip(f"nixl unavailable: {reason}")
    main = PrefillPeer(EngineSpec("dense", LAYERS, PAGES, BS),
                       EngineSpec("strided", LAYERS, PAGES, BS, page_pad_rows=3),
                       EngineSpec("epochs", LAYERS, PAGES, BS))
    victim = PrefillPeer(EngineSpec("victim", LAYERS, PAGES, BS))
    start_peers(main, victim)
    yield {"main": main, "victim": victim}
    for p in (main, victim):
        p.stop()
