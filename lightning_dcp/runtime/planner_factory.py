"""Which planner a fit plans with: the settings, the cost model and the module's limits put together.

The planner itself is pure (:mod:`lightning_dcp.planning`); this module only chooses its inputs:
the user's planner as given; else a :class:`~lightning_dcp.planning.planner.Planner` over the cost
model the strategy holds (given, measured by the profiler, or -- warned once --
:class:`~lightning_dcp.planning.default_cost.DefaultCostModel`), capped at the SP size the world and
the heads allow, with the static memory of the runtime's sharding mode
(:func:`~lightning_dcp.runtime.sharding.states.plan_cost_model`, refusing by name a cost model the mode
cannot plan with); in safe mode wrapped in the padded cost model and planner
(:mod:`lightning_dcp.planning.padded`). The SP sizes it may use come from the runtime's
:class:`~lightning_dcp.runtime.model.SPCap`: the cap (any size the heads allow, not only powers of two), the
head count through the cost model, and whether the module runs ring attention (sizes past the heads).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.default_cost import DefaultCostModel
from lightning_dcp.planning.padded import PaddedCostModel, PaddedPlanner
from lightning_dcp.planning.planner import POLICIES, Planner
from lightning_dcp.planning.prices import CollectivePrices
from lightning_dcp.planning.sample_names import SampleNamer
from lightning_dcp.runtime.model import SPCap
from lightning_dcp.runtime.settings import DCPSettings
from lightning_dcp.runtime.sharding.states import ModelStates, plan_cost_model

__all__ = ["PlannerFactory"]


class PlannerFactory:
    """Builds the fit's planner (and re-plan planners) from fixed inputs.

    Args:
        settings: the strategy's settings (policy, seed, planner options, a user planner).
        world_size: ranks in the world.
        sp_cap: the SP sizes the runtime runs (cap, Ulysses sizes, ring attention or not).
        num_heads: the model's attention heads (named in the planner's SP-cap errors), if known.
        support: the module's support level (``"safe"`` plans padded micro-batches).
        states: the model states per rank under the runtime's sharding mode (``None``: the cost model's own).
        prices: the collectives' prices for the modes with collectives in the loop (``None``: the cost
            model's own, from its hardware or profile).
        sample_name: names a dataset index in the planners' errors (the train dataset's ``sample_name``).
    """

    def __init__(self, settings: DCPSettings, world_size: int, sp_cap: SPCap, num_heads: int | None,
                 support: str, states: ModelStates | None = None, prices: CollectivePrices | None = None,
                 sample_name: SampleNamer | None = None) -> None:
        self.settings = settings
        self.world_size = world_size
        self.sp_cap = sp_cap
        self.num_heads = num_heads
        self.support = support
        self.states = states
        self.prices = prices
        self.sample_name = sample_name
        self._warned_default = False

    def cost_model(self, given: CostModel | None, lengths: list[int], num_layers: int,
                   micro_batch_size: int = 1) -> CostModel:
        """The cost model to plan ``lengths`` with: ``given`` (profiled or the user's) with the sharding
        mode's static memory, padded in safe mode; a :class:`DefaultCostModel` when there is none (warned once)."""
        if self.support == "safe":
            base = given if given is not None else DefaultCostModel(0, 1, 4 * max(lengths))
            return base if isinstance(base, PaddedCostModel) else PaddedCostModel(base, micro_batch_size * max(lengths))
        if given is not None:
            return plan_cost_model(given, self.states, self.prices)
        if not self._warned_default:
            self._warned_default = True
            rank_zero_warn("DCPStrategy has no cost model (pass cost_model=, or add lightning_dcp's DCPProfiler); using "
                           "DefaultCostModel: SP size 1 for every sample, ranks balanced by gradient accumulation only")
        return plan_cost_model(DefaultCostModel(num_layers, self.num_heads or 1, 4 * max(lengths)), self.states,
                               self.prices)

    def planner(self, cost_model: CostModel, lengths: list[int]) -> Any:
        """A planner over ``cost_model`` (the user's planner, when one was given, is returned as is)."""
        if self.settings.planner is not None:
            return self.settings.planner
        cls = POLICIES.get(self.settings.policy)
        if cls is not None and cls.runtime_refusal:
            raise ValueError(f"policy {self.settings.policy!r} cannot train: {cls.runtime_refusal}; use it with "
                             "`lightning-dcp plan` / `simulate`, and train with policy='dcp'")
        opts = dict(self.settings.planner_options)
        opts.setdefault("max_sp_size", self.sp_cap.size)
        if self.sp_cap.reason is not None and opts["max_sp_size"] == self.sp_cap.size:
            opts.setdefault("sp_cap_reason", self.sp_cap.reason)
        opts.setdefault("ring", self.sp_cap.ring)  # ring items only for a module that runs ring attention
        opts.setdefault("sample_name", self.sample_name)
        planner = Planner(self.world_size, cost_model, policy=self.settings.policy, seed=self.settings.data_seed,
                          dataset_lengths=lengths, **opts)
        return PaddedPlanner(planner, cost_model) if isinstance(cost_model, PaddedCostModel) else planner

    def bounder(self, cost_model: CostModel | None) -> Any:
        """The per-step achievable bound (``dcp/step_bound_fraction``), for measured cost models only:
        its seconds mean nothing beside wall time for an analytic or default model."""
        from lightning_dcp.planning.profiled import ProfiledCostModel

        if not isinstance(cost_model, ProfiledCostModel):
            return None
        from lightning_dcp.planning.bound import StepBounder

        return StepBounder(cost_model, self.world_size, self.sp_cap.size)
