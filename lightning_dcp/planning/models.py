"""Named model descriptions: the paper's Transformer-1D / Transformer-2D (Table 1) and tiny CPU sizes.

A :class:`ModelSpec` is what the analytic cost model reasons about and what the reference
models in :mod:`lightning_dcp.models` are built from. Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a transformer, enough to count its FLOPs, bytes and parameters.

    Args:
        name: registry name.
        kind: ``"1d"`` (one attention per layer over the whole sequence) or ``"2d"`` (video
            DiT-like: spatial attention within each frame, then temporal attention across
            frames, each with its own MLP; one "layer" is that pair of blocks).
        num_layers: repeated layers (the ModuleList that recomputation and profiling act on).
        hidden_size: model width.
        num_heads: attention heads; SP sizes must divide it.
        causal: causal attention mask (1d language models).
        ffn_hidden_size: inner width of the MLP (SwiGLU for 1d, GELU for 2d).
        vocab_size: token vocabulary (1d); 0 for latent-input models.
        in_channels: latent channels per token after patchify (2d); 0 for token models.
        spatial_tokens: 2d only: tokens per frame the analytic cost model assumes when it
            only knows a sample's total length (``frames = length / spatial_tokens``).
    """

    name: str
    kind: str
    num_layers: int
    hidden_size: int
    num_heads: int
    causal: bool
    ffn_hidden_size: int
    vocab_size: int = 0
    in_channels: int = 0
    spatial_tokens: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def blocks_per_layer(self) -> int:
        """Attention+MLP blocks in one repeated layer (2 for 2d: spatial and temporal)."""
        return 2 if self.kind == "2d" else 1

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of hidden x ffn in one MLP (3 for SwiGLU, 2 for GELU)."""
        return 3 if self.kind == "1d" else 2

    def layer_params(self) -> int:
        """Parameters of one repeated layer (norm weights ignored)."""
        h = self.hidden_size
        block = 4 * h * h + self.mlp_matrices * h * self.ffn_hidden_size
        return self.blocks_per_layer * block

    def params(self) -> int:
        """All parameters: layers plus embedding and output head."""
        h = self.hidden_size
        if self.kind == "1d":
            edge = 2 * self.vocab_size * h
        else:
            edge = 2 * self.in_channels * h + 6 * h * h  # patch embed, un-patchify, timestep/adaLN MLPs
        return self.num_layers * self.layer_params() + edge

    def to_dict(self) -> dict:
        return asdict(self)


MODELS: dict[str, ModelSpec] = {
    # DCP paper, Appendix B, Table 1: 42 layers, 3072 hidden, 48 heads, ~5B parameters.
    "transformer-1d": ModelSpec("transformer-1d", "1d", 42, 3072, 48, True, 8192, vocab_size=32000),
    # Table 1: 28 layers, 1152 hidden, 16 heads. The paper's 1.2B includes text cross-attention,
    # which this spec leaves out (0.9B): the sequence-dependent costs are the same.
    "transformer-2d": ModelSpec("transformer-2d", "2d", 28, 1152, 16, False, 4608, in_channels=16, spatial_tokens=1024),
    # CPU sizes for tests, the demo and measured multi-process benchmarks.
    "tiny-1d": ModelSpec("tiny-1d", "1d", 4, 64, 4, True, 176, vocab_size=256),
    "tiny-2d": ModelSpec("tiny-2d", "2d", 4, 64, 4, False, 256, in_channels=16, spatial_tokens=64),
}


def get_model(name: str) -> ModelSpec:
    """The :class:`ModelSpec` registered as ``name``; the error lists the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}") from None
