"""One module per supported diffusers video transformer family: its adapter (``adapt_<family>``,
``is_<family>_adapted``), its packed forward and what else only it needs (attention processor, sample
builder, rotary tables).

* :mod:`~lightning_dcp.diffusers.families.wan`: Wan 2.1 / 2.2 (``WanTransformer3DModel``);
* :mod:`~lightning_dcp.diffusers.families.ltx`: LTX-Video (``LTXVideoTransformer3DModel``);
* :mod:`~lightning_dcp.diffusers.families.cogvideox`: CogVideoX 1.0 / 1.5 (``CogVideoXTransformer3DModel``);
* :mod:`~lightning_dcp.diffusers.families.hunyuan`: HunyuanVideo (``HunyuanVideoTransformer3DModel``).

What the families share stays one level up: packed inputs and their check
(:mod:`~lightning_dcp.diffusers.forward`), packed attention (:mod:`~lightning_dcp.diffusers.attention`),
samples (:mod:`~lightning_dcp.diffusers.samples`), joint rows (:mod:`~lightning_dcp.diffusers.joint`). The
family table (:data:`~lightning_dcp.diffusers.family.FAMILIES`) stands above these modules; none imports it.
"""
