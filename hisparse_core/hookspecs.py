"""pluggy hook specifications of the `hisparse` project.

Hooks only register things; the work is done by plain method calls on the objects they
register. A plugin is a module named by an entry point in the `hisparse.backends` group; it
must import nothing heavy (no torch, no CUDA) at module level, because every process that lists
or selects a backend imports every plugin.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from hisparse_core.backend import BackendSpec

PROJECT = "hisparse"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def hisparse_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Register the backends this plugin provides.

    Called once per process by the backend registry, the first time backends are listed or one
    is selected, after every entry point of the `hisparse.backends` group was imported.

    :param register: call it with one `hisparse_core.BackendSpec` per backend. The spec names the
        backend class by a "module:Class" string and carries a probe; neither is imported or
        run here. Registering a name twice raises `ValueError` naming both plugins.

    Use in a backend distribution::

        from hisparse_core import BackendSpec, hookimpl

        @hookimpl
        def hisparse_register_backends(register):
            register(BackendSpec(name="acme", factory="hisparse_acme.backend:AcmeBackend",
                                 probe=_probe, priority=50, capabilities=frozenset({...})))
    """
