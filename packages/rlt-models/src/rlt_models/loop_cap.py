"""The engine's loop cap (`max_model_loops`, `--max-model-loops`): the model depth T that a
family's parsed config is sized for.

A family declares three depths (`FamilyDeclaration`): `default_loops`, what a request runs when
it does not say (the checkpoint's loop count); `max_loops`, the engine's default cap on what a
request may ask; `loop_limit`, the largest cap an engine may set (None: any, the family's depth
is elastic). `apply_loop_cap` sets the cap: the config's `shape().num_loops` (the depth the
runner, the KV planes and the scheduler are sized for) and `declaration().max_loops` become
`max_model_loops`, while `declaration().default_loops` stays the checkpoint's count. Worked
example: a 2-loop Nanbeige checkpoint under `max_model_loops=4` keeps 4 KV planes per position;
a request without `max_loops` runs 2 loops, one may ask 1 to 4, 5 is refused.

A family whose config takes a cap has a field named `ENGINE_FIELD` (None: its default cap) that
is never read from nor written to config.json; a family without it accepts only its default
cap. The cap may not be below `default_loops`: a request that omits `max_loops` must be able
to run (a shallower model is a checkpoint setting: `hf_overrides`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlt_models.errors import ModelConfigError

ENGINE_FIELD = "max_model_loops"


def apply_loop_cap(config: Any, max_model_loops: int | None) -> Any:
    """`config` (a registered family's parsed config) with the engine's loop cap; None keeps
    the family's default cap. A cap the family does not allow is a `ModelConfigError` naming
    `max_model_loops` and the limit."""
    if max_model_loops is None:
        return config
    if isinstance(max_model_loops, bool) or not isinstance(max_model_loops, int):
        raise ModelConfigError(ENGINE_FIELD, f"must be a positive integer, got {max_model_loops!r}")
    declared = config.declaration()
    family = f"{declared.name} ({declared.architecture})"
    if max_model_loops < max(1, declared.default_loops):
        raise ModelConfigError(
            ENGINE_FIELD,
            f"{max_model_loops} is below {family}'s default depth {declared.default_loops}, "
            "which requests that omit max_loops run; to run fewer loops by default, change the "
            "checkpoint's loop count with hf_overrides (--hf-overrides)",
        )
    limit = declared.loop_limit
    if limit is not None and max_model_loops > limit:
        raise ModelConfigError(
            ENGINE_FIELD,
            f"{family} runs at most {limit} loops per token (its declared loop limit), got "
            f"{max_model_loops}",
        )
    if max_model_loops == declared.max_loops:
        return config
    if ENGINE_FIELD not in {field.name for field in dataclasses.fields(config)}:
        raise ModelConfigError(
            ENGINE_FIELD,
            f"{family} takes no engine loop cap: its depth is {declared.max_loops}, got "
            f"{max_model_loops}",
        )
    return dataclasses.replace(config, **{ENGINE_FIELD: max_model_loops})
