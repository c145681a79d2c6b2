"""The line DCPStrategy prints at fit start for :class:`~lightning_dcp.diffusers.VideoDiffusionModule`:
:func:`video_support_message` (the module's ``dcp_support_message``).

What the module trains (the diffusers class and its family), at which support level, how its samples are
packed and attend (each video to its own text: by cross-attention, or as rows of a joint sequence), the SP
sizes its heads allow, the blocks it recomputes, and the flow-matching loss.
"""

from __future__ import annotations

from typing import Any

__all__ = ["video_support_message"]


def video_support_message(module: Any, support: str) -> str | None:
    """The one fit-start line for a video module at ``support`` (``None`` in safe mode: the strategy says it)."""
    if support == "safe":
        return None
    from lightning_dcp.diffusers import family_of

    model = module.model
    family = family_of(model)
    heads, blocks = int(model.dcp_num_heads), len(model.dcp_repeated_layers())
    attend = ("joint attention over each video's text and video rows: lengths count both, text rows carry no loss"
              if family.joint else "self-attention within each video, cross-attention to its own text only")
    sp = (f"Ulysses SP groups of sizes dividing its {heads} attention heads" if support == "sp"
          else "SP size 1 (support='packed')")
    flow = module.flow
    trainer = getattr(module, "_trainer", None)
    reduction = getattr(getattr(trainer, "strategy", None), "loss_reduction", None) or module.loss_reduction or "token"
    return (f"DCPStrategy: {type(module).__name__} trains {type(model).__name__} ({family.label}) at support level "
            f"{support!r}: packed micro-batches of any-size videos ({attend}), "
            f"{sp}, per-block recompute of its {blocks} blocks; flow matching (shift {flow.shift:g}, weighting "
            f"{flow.weighting_scheme!r}, loss reduction {reduction!r}).")
