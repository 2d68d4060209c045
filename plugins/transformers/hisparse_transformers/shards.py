"""Where a model's sparse-attention layers sit (`device_map`), and the acknowledgements of the
workers that serve them.

A model loaded with `device_map` spreads its decoder layers over several devices. hisparse then
runs one worker per device (its runtimes, device caches, tables and host pool hold only that
device's layers), while one coordinator keeps the pages of every layer: a GPU block id and a host
block id name the same page on every device, so every worker runs the same command on its own
layers. An index group never spans two devices: a follower (a GLM-5 "shared" layer) replays its
leader's miss plan, which lives on the leader's device, so `place` refuses a layout that splits a
group, naming the layers.

`merge_reports` folds the workers' reports into one the coordinator can count against the number
of workers: transfers sum (a transfer is done once every worker did its layers), and a host block
copy is done only once every worker has copied its layers (one worker's report is not enough).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hisparse_core.errors import InvalidInputError
from hisparse_core.types import WorkerMetadata


@dataclass(frozen=True, slots=True)
class Placement:
    """The devices of a model's sparse-attention layers.

    `devices`: the distinct devices, in the order of their first layer; `layer_device[i]`: index
    into `devices` of layer i; `group_device[g]`: the same for index group g (all its layers).
    """

    devices: tuple[torch.device, ...]
    layer_device: tuple[int, ...]
    group_device: tuple[int, ...]

    @property
    def spread(self) -> bool:
        return len(self.devices) > 1

    def groups_on(self, d: int) -> list[int]:
        return [g for g, dev in enumerate(self.group_device) if dev == d]

    def layers_on(self, d: int) -> list[int]:
        return [i for i, dev in enumerate(self.layer_device) if dev == d]

    def describe(self) -> str:
        return "; ".join(f"{dev}: layers {_spans(self.layers_on(d))}" for d, dev in enumerate(self.devices))


def _spans(layers: Sequence[int]) -> str:
    out: list[str] = []
    for i in layers:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def layer_device(attention: Any) -> torch.device:
    """The device attention module `attention` computes on: its accelerate hook's execution
    device where one is installed on it, else the device of its latent projection's weight."""
    hook = getattr(attention, "_hf_hook", None)
    executes = getattr(hook, "execution_device", None)
    if executes is not None:
        return torch.device(executes)
    return attention.kv_a_proj_with_mqa.weight.device


def _tensors(module: Any) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers of an attention module (none for a stand-in without them)."""
    named = [getattr(module, "named_parameters", None), getattr(module, "named_buffers", None)]
    return [item for f in named if callable(f) for item in f()]


def place(attentions: Sequence[Any], groups: Sequence[Sequence[int]]) -> Placement:
    """The placement of these layers; `InvalidInputError` (one line, naming the layers and their
    devices) if an index group's follower sits on another device than its leader, or a layer's
    weights are offloaded (meta: accelerate's CPU or disk offload)."""
    per_layer = [layer_device(a) for a in attentions]
    for i, (attention, dev) in enumerate(zip(attentions, per_layer, strict=True)):
        # An offloading accelerate hook reports its execution device ("cpu") while the weights it
        # loads at each forward stay meta placeholders; hisparse's attention reads them directly.
        where = "" if dev.type != "meta" else "kv_a_proj_with_mqa.weight"
        where = where or next((name for name, t in _tensors(attention) if t.device.type == "meta"), "")
        if where:
            raise InvalidInputError(f"layer {i}'s attention weights are offloaded ({where} is on meta): hisparse runs "
                                    "each layer's attention where its weights are; expected a device_map with every "
                                    "decoder layer on a device (no 'cpu' or 'disk' offload of attention layers)")
    devices: list[torch.device] = []
    for dev in per_layer:
        if dev not in devices:
            devices.append(dev)
    for g in groups:
        leader = per_layer[g[0]]
        away = [i for i in g[1:] if per_layer[i] != leader]
        if away:
            i = away[0]
            raise InvalidInputError(
                f"layer {i} reuses the top-k of layer {g[0]} (an index-sharing follower) but sits on {per_layer[i]} "
                f"while layer {g[0]} sits on {leader}: a follower replays its leader's plan on the leader's device; "
                f"expected a device_map that keeps layers {g[0]}-{g[-1]} on one device")
    index = {dev: d for d, dev in enumerate(devices)}
    layer_dev = tuple(index[dev] for dev in per_layer)
    return Placement(tuple(devices), layer_dev, tuple(layer_dev[g[0]] for g in groups))


class ReportMerger:
    """Folds the reports of `num_workers` workers (one per device) into one (see the module
    docstring); host block copies wait here until every worker has reported them."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._copies: Counter[int] = Counter()

    def merge(self, reports: Sequence[WorkerMetadata]) -> WorkerMetadata:
        if len(reports) == 1 and self.num_workers == 1:
            return reports[0]
        enqueued: Counter[int] = Counter()
        completed: Counter[int] = Counter()
        for r in reports:
            enqueued.update(r.enqueued)
            completed.update(r.completed)
            self._copies.update(r.completed_host_copies)
        done = sorted(b for b, n in self._copies.items() if n >= self.num_workers)
        for b in done:
            del self._copies[b]
        return WorkerMetadata(dict(enqueued), dict(completed), tuple(done))


__all__ = ["Placement", "ReportMerger", "layer_device", "place"]
