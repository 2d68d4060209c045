"""Rank 1 of the shared host pool test: `python -m hisparse_conformance.peer REQUEST_JSON`.

Instantiates the backend class named by `factory` ("module:Class"), maps the shared pool as a
non-writer rank and prints one JSON line: whether it is a writer and the sha256 of each layer.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys

import torch

from hisparse_core.geometry import row_format
from hisparse_core.host_pool import HostPoolSpec


def main(argv: list[str]) -> int:
    request = json.loads(argv[0])
    module_name, _, qualname = request["factory"].partition(":")
    cls: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    backend = cls()  # type: ignore[operator]
    fields = dict(request["spec"])
    spec = HostPoolSpec(shared=True, row_format=row_format(fields.pop("row_format")), **fields)
    with backend.create_host_pool(spec) as pool:
        digests = [hashlib.sha256(pool.layer_view(layer).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
                   for layer in range(spec.num_layers)]
        print(json.dumps({"is_writer": pool.is_writer, "digests": digests}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
