"""The hisparse conformance suite: every backend, held to docs/resolver-contract.md.

Run it on an installed backend with::

    pytest --pyargs hisparse_conformance --hisparse-backend NAME

`hisparse_conformance.plugin` (loaded by pytest through the `pytest11` entry point) provides the
options and fixtures; the `test_*` modules here are the suite; `scenario`, `rig` and `model` are
the input generators, the storage harness and an independent model of the contract. This module
imports nothing, so loading the plugin stays cheap.
"""
