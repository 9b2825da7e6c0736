"""Which codecs a stage boundary and a gradient sync may use: the YAML's `compression:` and the planner's choice.

    compression: auto                  # default: the planner picks per boundary and per sync group
    compression:
      intra_region: none               # a codec, or auto (default auto)
      cross_region: int8               # a codec, or auto (default auto)
      boundaries: {0: int4_rotated}    # pin the boundary after stage i (overrides the classes)
      gradients: same                  # same (default) or a codec for gradients sent back
      sync: auto                       # gradient sync between pipelines: a codec, or auto (default auto)
      sync_topology: auto              # auto (default), ring or hierarchical (sum inside regions first)

With `auto`, the planner picks per boundary the least lossy codec that takes the link off
the critical path: the predicted step stays within 2% of what the most effective codec
would give (CODEC_SLACK), so `none` where the link is fast enough uncompressed.

`sync: auto` does the same per sync group (launcher/planning/sync_cost.py), among none, fp16 and
int8, and only for groups whose nodes span regions: gradient sync inside a region is
never compressed under auto. A pinned `sync:` codec applies to every group.

`sync_topology: auto` prices each group whose holders span regions both as one flat ring and
hierarchically (sum inside each region, the regions' leaders exchange, broadcast back) and keeps
the faster; `ring` and `hierarchical` pin the shape (hierarchical only where some region holds two
or more of a group's holders). A plan nobody priced (pinned, sync not auto) uses what is pinned,
and `auto` there means ring.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from hetlaunch.runtime.registry import CODEC_NAMES, codec_info

CodecName = Literal[CODEC_NAMES]
CodecOrAuto = Literal[("auto", *CODEC_NAMES)]
CodecOrSame = Literal[("same", *CODEC_NAMES)]
# Least lossy first: `auto` walks this order and stops at the first codec that is fast enough.
LOSSINESS: tuple[str, ...] = CODEC_NAMES
# What `auto` considers: bf16 has fp16's size with less precision; int4 without rotation has
# int4_rotated's size with more error on heavy-tailed activations.
AUTO_CANDIDATES: tuple[str, ...] = ("none", "fp16", "int8", "int4_rotated")
# What `sync: auto` considers across regions: a gradient error is carried into the next step
# (error feedback) but still perturbs every step, so nothing coarser than int8.
SYNC_AUTO_CANDIDATES: tuple[str, ...] = ("none", "fp16", "int8")
CODEC_SLACK = 0.02  # a less lossy codec is taken if the step gets at most this much slower


def _int_keys(value):
    # YAML keys like `0:` arrive as ints already; quoted ones ("0") are accepted too.
    if isinstance(value, dict):
        return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in value.items()}
    return value


class CompressionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    intra_region: CodecOrAuto = "auto"
    cross_region: CodecOrAuto = "auto"
    boundaries: Annotated[dict[int, CodecName], BeforeValidator(_int_keys)] = Field(default_factory=dict)
    gradients: CodecOrSame = "same"
    sync: CodecOrAuto = "auto"  # gradient sync between data-parallel pipelines
    sync_topology: Literal["auto", "ring", "hierarchical"] = "auto"  # its shape across regions

    def candidates(self, boundary: int, same_region: bool) -> tuple[str, ...]:
        """Codecs the planner may choose for the boundary after stage `boundary`."""
        if boundary in self.boundaries:
            return (self.boundaries[boundary],)
        choice = self.intra_region if same_region else self.cross_region
        return AUTO_CANDIDATES if choice == "auto" else (choice,)

    def gradient_codec(self, forward: str) -> str:
        return forward if self.gradients == "same" else self.gradients

    def sync_candidates(self, cross_region: bool) -> tuple[str, ...]:
        """Codecs the planner may choose for one sync group's gradients."""
        if self.sync != "auto":
            return (self.sync,)
        return SYNC_AUTO_CANDIDATES if cross_region else ("none",)


NONE = CompressionConfig(intra_region="none", cross_region="none", sync="none")


def wire_ratio(codec: str) -> float:
    """Bytes on the wire per raw byte of a float32 activation (the blockwise codecs add scales)."""
    return codec_info(codec).wire_ratio()
