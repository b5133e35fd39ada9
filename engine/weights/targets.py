"""Where each checkpoint tensor lands in a built model: a `Target` per Hugging Face name, which the
loader (loader.py) validates against and copies into, and the weight store (store.py) and the
group updates (group_updates.py) name pieces by.

Rules:
- A packed parameter (`MergedLinear`) takes one checkpoint tensor per shard: `...self_attn.q_proj.weight`
  is the q rows of `...self_attn.qkv_proj.weight`.
- Packed experts (`PackedExperts`) take Hugging Face's per-expert tensors (`...mlp.experts.3.up_proj.weight`
  is expert 3's up rows of `...mlp.experts.gate_up_proj`), or transformers 5's packed ones
  (`...mlp.experts.gate_up_proj`), which stand for all of theirs (`Target.covers`). A family's other
  names for a tensor (`checkpoint_aliases`: Mixtral's `block_sparse_moe.experts.{e}.w1`) stand for
  it the same way.
- Targets are views taken once: a model's parameters never move after it is bound to its memory
  (engine/weights/store.py), so the caller may keep the table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from engine.models.linear import MergedLinear
from engine.models.moe import ExpertSlot, PackedExperts
from engine.parallel import Shard


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: `rows` of a parameter (all of it when None); `view` is
    those bytes (contiguous, but for a tensor-parallel rank's `parts` of a packed name), taken when
    the targets are listed. `shard`: the part of the checkpoint tensor this tensor-parallel rank
    holds (None: all of it). A packed name (transformers 5's `mlp.experts.gate_up_proj`) `covers`
    the checkpoint names it fills at once; where its bytes do not land in `view` as they come (a
    rank's gate and up rows of it), `parts` are the targets of its pieces, each a shard of the
    whole tensor."""

    rows: slice | None
    view: torch.Tensor
    shard: Shard | None = None
    covers: tuple[str, ...] = ()
    parts: tuple[Target, ...] = ()

    @property
    def whole(self) -> bool:
        """Whether the checkpoint tensor is `view`'s bytes as they come (it may be received there)."""
        return self.shard is None and not self.parts

    @cached_property
    def shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's (full) shape."""
        if self.parts:
            return self.parts[0].shape
        shape = list(self.view.shape)
        if self.shard is not None:
            shape[self.shard.dim] = self.shard.total
        return tuple(shape)

    def source(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor given whole (or already sliced)."""
        s = self.shard
        if s is None or tensor.shape[s.dim] == s.length:
            return tensor
        return tensor.narrow(s.dim, s.start, s.length)

    @property
    def dest(self) -> torch.Tensor:
        """The bytes the rank's part fills (a padded vocabulary's last rank: its first rows)."""
        s = self.shard
        return self.view if s is None or self.view.shape[s.dim] == s.length else self.view.narrow(s.dim, 0, s.length)

    def copies(self, tensor: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) pairs that load the checkpoint tensor `tensor`."""
        return [(t.dest, t.source(tensor)) for t in (self.parts or (self,))]


# Names of a model riding in the target's weights (speculative decoding's draft,
# engine/runner/draft_model.py): a full checkpoint of the target need not hold them.
OPTIONAL_PREFIX = "draft."


def checkpoint_targets(model: nn.Module) -> dict[str, Target]:
    """Checkpoint name -> target, for every tensor a full checkpoint must provide, then the packed
    names that stand for several of them (their `covers`)."""
    targets: dict[str, Target] = {}
    packed: dict[str, Target] = {}
    for module_name, module in model.named_modules():
        prefix = module_name.rpartition(".")[0]
        if isinstance(module, PackedExperts):
            _expert_targets(module_name, module, targets, packed)
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(module, MergedLinear):
                for part, rows in module.rows.items():
                    name = f"{prefix}.{part}.{param_name}" if prefix else f"{part}.{param_name}"
                    shard = module.parts[part]
                    targets[name] = Target(rows, param.data[rows], None if shard.whole else shard)
            else:
                name = f"{module_name}.{param_name}" if module_name else param_name
                targets[name] = Target(None, param.data, getattr(module, "shards", {}).get(param_name))
    # Another name a family's checkpoints give a tensor (Mixtral's `block_sparse_moe...w1`) stands
    # for it as a packed name stands for its parts: one target, covering the model's name.
    aliases = model.checkpoint_aliases(list(targets)) if hasattr(model, "checkpoint_aliases") else {}
    for alias, name in aliases.items():
        t = targets[name]
        packed[alias] = Target(t.rows, t.view, t.shard, covers=(name,))
    return targets | packed


def _expert_targets(name: str, experts: PackedExperts, targets: dict[str, Target], packed: dict[str, Target]) -> None:
    """The targets of one `PackedExperts` module (`name`): its per-expert names into `targets`,
    its packed names into `packed`."""
    params = dict(experts.named_parameters(recurse=False))

    def target(slot: ExpertSlot) -> Target:
        return Target(None, params[slot.param].data[slot.index], slot.shard)

    covers: dict[str, list[str]] = {p: [] for p in params}
    for suffix, slot in experts.checkpoint_parts().items():
        targets[f"{name}.{suffix}"] = target(slot)
        covers[slot.param].append(f"{name}.{suffix}")
    for suffix, slots in experts.packed_parts().items():
        param = slots[0].param
        parts = () if len(slots) == 1 and slots[0].shard is None else tuple(target(s) for s in slots)
        packed[f"{name}.{suffix}"] = Target(None, params[param].data, None, tuple(covers[param]), parts)


def checkpoint_names(targets: dict[str, Target], names: Iterable[str]) -> list[str]:
    """The checkpoint tensors that `names` fill: a packed name stands for the ones it covers."""
    out: list[str] = []
    for name in names:
        target = targets.get(name)
        if target is not None and target.covers:
            out.extend(target.covers)
        else:
            out.append(name)
    return out


def ignored(model: nn.Module, name: str) -> bool:
    """A checkpoint tensor the model does not load (rotary tables, a tied lm_head)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    config = getattr(model, "config", None)
    return name == "lm_head.weight" and bool(getattr(config, "tie_word_embeddings", False))
