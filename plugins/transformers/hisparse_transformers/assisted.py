"""What an assisted `generate` asks of hisparse, read off its arguments before anything runs.

transformers' assisted generation (`prompt_lookup_num_tokens=k`, or `assistant_model=draft`)
proposes up to k candidate tokens a step and verifies them in one forward of k + 1 tokens, then
crops the rejected ones off the cache. hisparse resolves those k + 1 rows per request as one union,
so the engine must have been enabled for k (`speculative_tokens`), and the draft must be one whose
proposals are the model's own token ids and whose cache transformers can crop. `assisted_plan`
returns the bound on the candidates (or None for a generate that is not assisted) and refuses,
with one line, what hisparse cannot serve. It imports nothing of the package.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hisparse_core.checks import as_index
from hisparse_core.errors import InvalidInputError

#: Draft-length schedules that grow the number of candidates past its starting value.
_GROWING = ("heuristic", "heuristic_transient")


@dataclass(frozen=True, slots=True)
class AssistedPlan:
    """An assisted generate: `setting` names what bounds its candidates, `candidates` the bound."""

    mode: str                # "prompt lookup" or "assistant model"
    setting: str             # the setting the user changes to change the bound
    candidates: int          # most candidate tokens one verification step checks


def _int_setting(name: str, value: Any, minimum: int = 0, *, whole_floats: bool = True) -> int:
    """`value` as an int >= `minimum`: any integral value (`as_index`: a numpy integer, a 0-dim
    integer tensor), not a bool (`whole_floats`: 3.0 passes as 3, as transformers reads it)."""
    whole = int(value) if whole_floats and isinstance(value, float) and value.is_integer() else as_index(value)
    if whole is None or whole < minimum:
        raise InvalidInputError(f"{name} must be an int >= {minimum}, got {value!r}")
    return whole


def draft_cache_problem(draft: Any) -> str | None:
    """Why transformers could not crop `draft`'s cache between verification steps, or None."""
    from transformers.cache_utils import DynamicCache

    handle = getattr(draft, "_hisparse_handle", None)
    if handle is not None and not getattr(handle, "closed", True):
        return ("has hisparse enabled: transformers keeps the draft's cache across the target's verification steps "
                "(one draft generate per step, the same cache each time), and a hisparse cache serves one generate; "
                "disable hisparse on the draft (it then runs with its own DynamicCache)")
    supports = getattr(type(draft), "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():
        return f"({type(draft).__name__}) keeps a recurrent state of its own, which cannot be cropped"
    implementation = getattr(getattr(draft, "generation_config", None), "cache_implementation", None)
    if implementation not in (None, "dynamic", "offloaded"):
        return (f"has generation_config.cache_implementation={implementation!r}, whose layers cannot be cropped; "
                "expected None or 'dynamic'")
    config = getattr(draft, "config", None)
    if config is not None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        probe = DynamicCache(config=text)
        if not probe.is_croppable:
            kinds = sorted({type(layer).__name__ for layer in probe.layers if not layer.is_croppable})
            return f"builds cache layers that cannot be cropped ({', '.join(kinds)})"
    return None


def assisted_plan(model: Any, kwargs: dict[str, Any], setting: Callable[[str], Any]) -> AssistedPlan | None:
    """The assisted generation `kwargs` ask for (None: a plain generate). `setting(name)` reads a
    generation setting as generate resolves it. Raises `InvalidInputError` (one line) for what
    hisparse cannot serve."""
    for name, what in (("assistant_early_exit", "early-exit self-speculation"),
                       ("use_mtp", "multi-token-prediction drafting")):
        if setting(name) not in (None, False):
            raise InvalidInputError(f"{name}={setting(name)!r} ({what}) is not supported with hisparse; use "
                                    "prompt_lookup_num_tokens or an assistant_model")
    kind = setting("speculation_type")
    if kind is not None:
        raise InvalidInputError(f"speculation_type={kind!r} is not supported with hisparse; use "
                                "prompt_lookup_num_tokens or an assistant_model")
    lookup = setting("prompt_lookup_num_tokens")
    if lookup is not None:         # transformers prefers prompt lookup when both are given
        # transformers compares it with ints and slices by it: 3.0 and 0 fail inside its generate.
        k = _int_setting("prompt_lookup_num_tokens", lookup, 1, whole_floats=False)
        return AssistedPlan("prompt lookup", "prompt_lookup_num_tokens", k)
    draft = kwargs.get("assistant_model")
    if draft is None:
        if kwargs.get("assistant_tokenizer") is not None:
            raise InvalidInputError("assistant_tokenizer without an assistant_model; pass both or neither")
        return None
    if kwargs.get("assistant_tokenizer") is not None:
        raise InvalidInputError("assistant_tokenizer is given: a draft with another tokenizer (universal assisted "
                                "decoding) is not supported with hisparse, which verifies the draft's token ids as "
                                "the model's own; expected a draft with the model's tokenizer and no "
                                "assistant_tokenizer")
    ours = model.config.get_text_config().vocab_size
    theirs = getattr(getattr(draft, "config", None), "vocab_size", None)
    if hasattr(getattr(draft, "config", None), "get_text_config"):
        theirs = draft.config.get_text_config().vocab_size
    if theirs != ours:
        raise InvalidInputError(f"the assistant_model's vocabulary has {theirs} ids and the model's {ours}: a draft "
                                "with another tokenizer is not supported with hisparse (it verifies the draft's ids "
                                f"as the model's own); expected a draft with the model's tokenizer (vocab_size={ours})")
    if draft is model:
        raise InvalidInputError("assistant_model is the model itself; expected a separate (smaller) draft model")
    problem = draft_cache_problem(draft)
    if problem is not None:
        raise InvalidInputError(f"the assistant_model {problem}; assisted generation crops the draft's cache every "
                                "step")
    # transformers reads the draft length off the draft's own generation config (with its defaults).
    config = copy.deepcopy(draft.generation_config)
    defaults = getattr(config, "_get_default_generation_params", None)
    if callable(defaults):
        config.update(**defaults(), defaults_only=True)
    schedule = getattr(config, "num_assistant_tokens_schedule", None) or "constant"
    tokens = getattr(config, "num_assistant_tokens", None)
    tokens = _int_setting("assistant_model.generation_config.num_assistant_tokens", 20 if tokens is None else tokens)
    if schedule in _GROWING:
        raise InvalidInputError(
            f"assistant_model.generation_config.num_assistant_tokens_schedule={schedule!r} grows the draft past "
            f"num_assistant_tokens={tokens} (by 2 a step while every candidate is accepted), beyond any bound the "
            "hot buffer was sized for; expected num_assistant_tokens_schedule='constant'")
    return AssistedPlan("assistant model", "assistant_model.generation_config.num_assistant_tokens", tokens)
