"""Named model descriptions: the DCP paper's Transformer-1D / -2D (Table 1), Llama-2 7B and 70B, Wan 2.1 (1.3B,
14B), LTX-Video 2B, HunyuanVideo 13B and tiny CPU sizes.

A :class:`ModelSpec` is what the analytic cost model reasons about and what the reference models in
:mod:`lightning_dcp.models` are built from (``"1d"``, ``"2d"``; the ``"3d"`` shapes are for planning and simulation:
train them with diffusers' models and plan with their measured profile). Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

TIMESTEP_FREQ_DIM = 256
"""Sinusoidal timestep features fed to a 3d model's timestep MLP (Wan's ``freq_dim``)."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a transformer, enough to count its FLOPs, bytes and parameters.

    Args:
        name: registry name.
        kind: ``"1d"`` (one attention per layer over the whole sequence), ``"2d"`` (video DiT: spatial attention in
            each frame, then temporal attention across frames, each with its MLP; a "layer" is that pair of blocks)
            or ``"3d"`` (Wan 2.1-like: full self-attention over a sample's video tokens, cross-attention of each to
            the sample's ``text_len`` text tokens, a GELU MLP, each modulated by the timestep embedding).
        num_layers: repeated layers (the ModuleList that recomputation and profiling act on).
        hidden_size, num_heads: model width; attention heads (Ulysses sizes divide it).
        causal: causal attention mask (1d language models).
        ffn_hidden_size: inner width of the MLP (SwiGLU for 1d, GELU for 2d and 3d).
        vocab_size: token vocabulary (1d); 0 for latent-input models.
        in_channels: latent channels per token after patchify (2d, 3d); 0 for token models.
        spatial_tokens: 2d: tokens per frame (``frames = length / spatial_tokens``).
        text_len, text_dim: 3d: text tokens per sample (the text encoder's padded length, 512 for umT5) and their
            width, projected to ``hidden_size`` once per sample (4096 for umT5-XXL).
        num_kv_heads: key/value heads (grouped-query attention); 0: as many as ``num_heads``.
        stored_layer_params: parameters one layer *stores* when that differs from the weights a token passes through
            (HunyuanVideo's dual-stream blocks); 0: the same. In :meth:`params` (memory), not in FLOPs.
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
    text_len: int = 0
    text_dim: int = 0
    num_kv_heads: int = 0
    stored_layer_params: int = 0

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

    @property
    def cross_attention(self) -> bool:
        """Whether each layer cross-attends to the sample's text (3d with ``text_len > 0``)."""
        return self.kind == "3d" and self.text_len > 0

    def cross_kv_params(self) -> int:
        """Parameters of one layer's cross-attention key and value projections (0 without cross-attention).

        They act on the sample's ``text_len`` text tokens, not on its video tokens.
        """
        return 2 * self.hidden_size * self.hidden_size if self.cross_attention else 0

    def layer_params(self) -> int:
        """Parameters of one repeated layer (norm weights, biases and modulation tables ignored).

        Per block: q, k, v, o projections (``4 h^2``; k and v narrower with grouped-query attention) and
        the MLP; a layer with cross-attention adds its q, k, v, o (another ``4 h^2``).
        """
        h = self.hidden_size
        kv = h * self.num_kv_heads // self.num_heads if self.num_kv_heads else h
        block = 2 * h * h + 2 * h * kv + self.mlp_matrices * h * self.ffn_hidden_size
        if self.cross_attention:
            block += 4 * h * h
        return self.blocks_per_layer * block

    def edge_params(self) -> int:
        """Parameters outside the repeated layers: embedding and output head (and for video
        models the patch embedding, un-patchify, timestep and text-projection MLPs)."""
        h = self.hidden_size
        if self.kind == "1d":
            return 2 * self.vocab_size * h
        if self.kind == "3d":
            # patch embed + un-patchify; timestep MLP (freq -> h -> h) and its projection to the six
            # modulation vectors; text MLP (text_dim -> h -> h) when the layers cross-attend to text
            text = (self.text_dim + h) * h if self.cross_attention else 0
            return 2 * self.in_channels * h + (TIMESTEP_FREQ_DIM + h) * h + 6 * h * h + text
        return 2 * self.in_channels * h + 6 * h * h  # patch embed, un-patchify, timestep/adaLN MLPs

    def params(self) -> int:
        """All parameters: layers plus :meth:`edge_params`."""
        return self.num_layers * (self.stored_layer_params or self.layer_params()) + self.edge_params()

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
    # Llama-2-7B's shape (Touvron et al. 2023): 32 layers, 4096 hidden, 32 heads, SwiGLU 11008,
    # 32000 vocabulary, untied embedding and head: 6.74B parameters.
    "llama-7b": ModelSpec("llama-7b", "1d", 32, 4096, 32, True, 11008, vocab_size=32000),
    # Wan 2.1 text-to-video (Wan-Video/Wan2.1 configs, diffusers' WanTransformer3DModel): patch
    # (1, 2, 2) over a 16-channel latent of a (4, 8, 8)-stride VAE (in_channels = 16 * 1 * 2 * 2),
    # umT5-XXL text of 512 tokens x 4096, 128-dim heads. 1.3B: dim 1536, 30 layers, 12 heads,
    # ffn 8960 (1.42B parameters counted here). 14B: dim 5120, 40 layers, 40 heads, ffn 13824.
    "wan-1.3b": ModelSpec("wan-1.3b", "3d", 30, 1536, 12, False, 8960, in_channels=64, text_len=512, text_dim=4096),
    "wan-14b": ModelSpec("wan-14b", "3d", 40, 5120, 40, False, 13824, in_channels=64, text_len=512, text_dim=4096),
    # LTX-Video 2B (Lightricks/LTX-Video 0.9.x, diffusers' LTXVideoTransformer3DModel defaults): patch 1 over
    # the 128-channel latent of its (8, 32, 32)-stride VAE, 28 layers, dim 2048, 32 heads of 64, GELU MLP 8192,
    # cross-attention to T5-XXL text of 128 tokens x 4096 (1.922B parameters counted here, 1.923B in diffusers).
    "ltx-2b": ModelSpec("ltx-2b", "3d", 28, 2048, 32, False, 8192, in_channels=128, text_len=128, text_dim=4096),
    # Llama-2-70B (Touvron et al. 2023): 80 layers, 8192 hidden, 64 heads with 8 key/value heads
    # (grouped-query attention), SwiGLU 28672, 32000 vocabulary: 68.98B parameters counted here.
    "llama-70b": ModelSpec("llama-70b", "1d", 80, 8192, 64, True, 28672, vocab_size=32000, num_kv_heads=8),
    # HunyuanVideo 13B (diffusers' HunyuanVideoTransformer3DModel defaults): 20 dual-stream + 40 single-stream
    # blocks, 3072 hidden, 24 heads of 128, MLP ratio 4, patch (1, 2, 2) over a 16-channel latent. The
    # nearest spec our kinds describe: 60 "3d" layers without cross-attention (joint attention: a
    # sample's text tokens are part of its length), each passing a token through 12 h^2 weights (the
    # single-stream block's fused qkv+MLP, or one stream of a dual block), storing 215M parameters on
    # average (dual blocks keep two streams; adaLN modulation tables): 12.9B in all.
    "hunyuanvideo-13b": ModelSpec("hunyuanvideo-13b", "3d", 60, 3072, 24, False, 12288, in_channels=64,
                                  stored_layer_params=215_000_000),
}


def get_model(name: str) -> ModelSpec:
    """The :class:`ModelSpec` registered as ``name``; the error lists the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}") from None
