"""Pure-Python planning core: plan schema, cost models, policies, simulator, length distributions.

Nothing here imports torch or torch.distributed.
"""

from lightning_dcp.planning.cost_model import CostModel, ItemCost
from lightning_dcp.planning.plan import PLAN_SCHEMA, Plan, PlanError, StepPlan, WorkItem
from lightning_dcp.planning.checks import validate_plan, validate_step
from lightning_dcp.planning.profile import PROFILE_SCHEMA, ProfileError, load_profile, save_profile, validate_profile

__all__ = [
    "CostModel", "ItemCost", "PLAN_SCHEMA", "Plan", "PlanError", "StepPlan", "WorkItem", "validate_plan",
    "validate_step", "PROFILE_SCHEMA", "ProfileError", "load_profile", "save_profile", "validate_profile",
]

# Planner, policies, simulator (issue #2).
from lightning_dcp.planning.errors import PlanningError  # noqa: E402
from lightning_dcp.planning.planner import POLICIES, Planner, default_global_batch_tokens, plan  # noqa: E402
from lightning_dcp.planning.simulator import SimulationResult, simulate  # noqa: E402

__all__ += ["PlanningError", "POLICIES", "Planner", "default_global_batch_tokens", "plan", "SimulationResult", "simulate"]

# Per-step achievable bound (issue #10).
from lightning_dcp.planning.bound import StepBound, StepBounder, plan_step_bound, step_bound, step_bound_parts  # noqa: E402

__all__ += ["StepBound", "StepBounder", "plan_step_bound", "step_bound", "step_bound_parts"]
