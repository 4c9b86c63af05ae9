"""`Plan`: the static plan a `generate` call ran, which `decode(..., plan=)` replays inside a
user's `jax.jit`.

Under draft_len="auto" `generate` asks its `Tuner` how to run a call: the program (the method with
the shape "auto" chose: LogitSpec's tree size, the multi-path methods' paths; a fixed length where
the backend chooses one program per call; AR's program where a remembered verdict decodes
plainly), the adaptive loop's static plan (its longest draft, early-stop threshold, whether it caps
each step) and the loop's cost inputs, calibrated on the compiled program. Every one of these
shapes the program or its choices, so with sampling they decide which random draws are used.
`GenerateOutput.plan` holds them, and `decode` with that plan, the same key and the same prompts
gives `generate`'s tokens. Without a plan, `decode` uses `prior_plan`: the fixed relative costs
and the prior acceptance, the same on every machine and in every process.
"""

from __future__ import annotations

import dataclasses

from ssd_jax.errors import InputError
from ssd_jax.methods import Method
from ssd_jax.sampling import SamplingParams
from ssd_jax.tuning.cost_model import AutoPlan


def model_shapes(target, draft) -> tuple:
    """The configs of the target and of each draft model: what a plan's programs were shaped for."""
    drafts = draft if isinstance(draft, (tuple, list)) else (draft,)
    return (target.config,) + tuple(d.config for d in drafts if d is not None and hasattr(d, "config"))


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static plan of one `generate` call (module docstring); hashable, so it may also be a
    static argument of `jax.jit`.

    method: the method object the call was given. program: the method its program ran (shaped,
    fixed, or `AR()`). loop: the adaptive loop's `AutoPlan` (None: a fixed program). costs: the
    loop's cost inputs, float32 values (None: a fixed program). max_new_tokens, sampling and
    shapes (the models' configs): what the plan was made for."""

    method: Method
    program: Method
    loop: AutoPlan | None
    costs: tuple[float, ...] | None
    max_new_tokens: int
    sampling: SamplingParams
    shapes: tuple

    def check(self, method: Method, target, draft, sampling: SamplingParams, max_new_tokens: int) -> None:
        """InputError unless this plan was made for this method, these models' shapes, sampling
        and max_new_tokens."""
        if method != self.method:
            raise InputError(f"plan was made for method {self.method!r}, not {method!r}")
        if int(max_new_tokens) != self.max_new_tokens:
            raise InputError(f"plan was made for max_new_tokens={self.max_new_tokens}, not {max_new_tokens}")
        if sampling != self.sampling:
            raise InputError(f"plan was made for sampling {self.sampling!r}, not {sampling!r}")
        shapes = model_shapes(target, draft)
        if shapes != self.shapes:
            names = ", ".join(type(c).__name__ for c in shapes)
            raise InputError(f"plan was made for models of other shapes than these ({names}): "
                             f"{_first_difference(self.shapes, shapes)}")


def _first_difference(planned: tuple, given: tuple) -> str:
    """What differs first between two tuples of model configs, in words."""
    if len(planned) != len(given):
        return f"{len(planned)} model(s) planned, {len(given)} given"
    for index, (a, b) in enumerate(zip(planned, given)):
        if a != b:
            name = "the target" if index == 0 else f"draft {index - 1}"
            fields = [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name, None)] \
                if dataclasses.is_dataclass(a) and type(a) is type(b) else ["its type"]
            return f"{name} differs in {', '.join(fields[:4])}"
    return "none"


def fixed_plan(method: Method, program: Method, target, draft, sampling: SamplingParams, max_new_tokens: int,
               loop: AutoPlan | None = None, costs=None) -> Plan:
    """The Plan of a call of `method` that ran `program` (with the adaptive loop's plan and cost
    inputs where it ran the adaptive loop)."""
    return Plan(method=method, program=program, loop=loop,
                costs=None if costs is None else tuple(float(x) for x in costs),
                max_new_tokens=int(max_new_tokens), sampling=sampling, shapes=model_shapes(target, draft))
