"""Rank 1 of the shared host pool tests: `python -m hisparse_conformance.peer REQUEST_JSON`.

Instantiates the backend class named by `factory` ("module:Class"), maps the shared pool as a
non-writer rank and prints one JSON line: whether it is a writer and the sha256 of each layer.
With `restores` in the request (`[[transfer_id, host_block, device_block], ...]`, and
`device_blocks`), it also binds a runtime to the pool's layers and zeroed device caches, restores
those pages through its own transfer engine, drains it, and adds the sha256 of each restored
device block per layer (`restored`), the drain's acknowledgements and the pool's digests after.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from hisparse_core.backend import Backend
from hisparse_core.discovery import import_factory
from hisparse_core.geometry import RuntimeConfig, row_format
from hisparse_core.host_pool import HostPool, HostPoolSpec
from hisparse_core.types import PageTransfer


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.view(torch.uint8).cpu().contiguous().numpy().tobytes()).hexdigest()


def _restore(backend: Backend, pool: HostPool, spec: HostPoolSpec, restores: list[list[int]],
             device_blocks: int) -> dict[str, object]:
    fmt, bs = spec.row_format, spec.block_size
    cfg = RuntimeConfig(max_batch_rows=2, max_requests=2, top_k=bs, hot_rows=bs, block_size=bs, max_pages=4,
                        row_format=fmt, num_layers=spec.num_layers)
    caches = [torch.zeros((device_blocks, bs, fmt.width), dtype=fmt.dtype, device=backend.device)
              for _ in range(spec.num_layers)]
    runtime = backend.create_runtime(cfg)
    runtime.bind([pool.layer_view(layer) for layer in range(spec.num_layers)], caches)
    engine = backend.create_transfer_engine(pool, [runtime])
    engine.submit_pages([PageTransfer(ident, host, (dev,), restore=True) for ident, host, dev in restores])
    done = engine.drain()
    return {"restored": [[_digest(caches[layer][dev]) for _, _, dev in restores] for layer in range(spec.num_layers)],
            "enqueued": sorted(done.enqueued), "completed": sorted(done.completed),
            "after": [_digest(pool.layer_view(layer)) for layer in range(spec.num_layers)]}


def main(argv: list[str]) -> int:
    request = json.loads(argv[0])
    backend = import_factory(request["factory"])()  # type: ignore[operator]
    fields = dict(request["spec"])
    spec = HostPoolSpec(shared=True, row_format=row_format(fields.pop("row_format")), **fields)
    with backend.create_host_pool(spec) as pool:
        report: dict[str, object] = {"is_writer": pool.is_writer,
                                     "digests": [_digest(pool.layer_view(layer)) for layer in range(spec.num_layers)]}
        if "restores" in request:
            report.update(_restore(backend, pool, spec, request["restores"], request["device_blocks"]))
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
