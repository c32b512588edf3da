"""The planner: say before a run what fits, where everything lives and how fast it will go.

- :mod:`nvoffload.planner.profile` -- :class:`MachineProfile`: what a machine's engines do (built-in
  profiles of common GPU servers, or measured);
- :mod:`nvoffload.planner.calibrate` -- ``nvoffload calibrate``: measure this machine through nvoffload's
  own code;
- :mod:`nvoffload.planner.cost` -- ``nvoffload plan``: the step predicted from a model's shape, the batch,
  the budgets and a profile.
"""

from nvoffload.planner.cost import (
    ModelShape,
    Plan,
    PlanRequest,
    delayed_update_option,
    plan,
    plan_batch,
    state_precision_options,
)
from nvoffload.planner.profile import (
    BUILTIN_PROFILES,
    Drive,
    MachineProfile,
    load_profile,
)

__all__ = ["BUILTIN_PROFILES", "Drive", "MachineProfile", "ModelShape", "Plan", "PlanRequest", "delayed_update_option", "load_profile", "plan", "plan_batch", "state_precision_options"]
