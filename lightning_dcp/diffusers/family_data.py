"""An encode output folder's samples as the model's family takes them: :func:`family_dataset`.

:class:`~lightning_dcp.diffusers.EncodedVideoDataset` builds Wan's samples (:func:`~lightning_dcp.diffusers.video_sample`,
text zero-padded to 512 tokens). The same latents and prompt embeddings train the other families once their
own sample function builds them: LTX-Video's :func:`~lightning_dcp.diffusers.ltx_video_sample` (unpadded text,
the pipeline's rotary scale) and CogVideoX's :func:`~lightning_dcp.diffusers.cogvideox_sample` (the prompt's
tokens are rows of the sequence, so a sample's length counts them). HunyuanVideo also needs each prompt's
pooled CLIP projection, which an encode folder does not hold: refused, saying so.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from lightning_dcp.diffusers.encoded import EncodedVideoDataset
from lightning_dcp.diffusers.family import VideoFamily

__all__ = ["FamilySamples", "family_dataset"]


class FamilySamples(Dataset):
    """The samples of an :class:`~lightning_dcp.diffusers.EncodedVideoDataset` (made with ``text_len=None``) built
    by ``family.sample``; ``lengths`` count the prompt's rows too for a joint-attention family."""

    def __init__(self, encoded: EncodedVideoDataset, family: VideoFamily) -> None:
        self.encoded, self.family = encoded, family
        self.lengths = [n + (r.text_tokens if family.joint else 0) for n, r in zip(encoded.lengths, encoded.records)]

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        return self.encoded.shapes

    def __len__(self) -> int:
        return len(self.encoded)

    def __getitem__(self, index: int) -> dict[str, Any]:
        latent, text = self.encoded.tensors(index)
        return self.family.sample(latent, text, self.encoded.patch_size, index=index)


def family_dataset(root: str, family: VideoFamily, patch_size: tuple[int, int, int]) -> Dataset:
    """The training samples of the encode folder ``root`` for a model of ``family`` with ``patch_size``.

    Raises:
        ValueError: HunyuanVideo (its samples need the prompts' pooled CLIP projections, which encoding does not
            store).
    """
    if family.class_name == "WanTransformer3DModel":
        return EncodedVideoDataset(root, patch_size=patch_size)
    if family.class_name == "HunyuanVideoTransformer3DModel":
        raise ValueError(f"{family.label} trains on samples with each prompt's pooled CLIP projection "
                         "(hunyuan_sample(..., pooled_projections=...)), which an encode folder does not hold; build "
                         "your dataset with lightning_dcp.diffusers.hunyuan_sample instead of train-video's")
    return FamilySamples(EncodedVideoDataset(root, patch_size=patch_size, text_len=None), family)
