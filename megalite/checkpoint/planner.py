"""DCP planners for tensors held as explicit chunks of global tensors.

A rank describes what it holds as {global name: Entry(size, chunks)}, each chunk a local
tensor (a view) at `offsets` in the global tensor. One rank may hold several chunks of a
tensor (a ZeRO slice crossing rows, SwiGLU's [gate; up] blocks), which DTensor cannot
express. Saving writes every chunk; loading asks DCP's resharding for the overlap of each
saved chunk with each wanted chunk and copies straight into the views, so the model and
optimizer tensors are filled in place at any topology.
"""

from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.default_planner import _validate_global_plan, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megalite.checkpoint.storage import CheckpointError


@dataclass
class Entry:
    size: tuple
    dtype: torch.dtype
    chunks: list = field(default_factory=list)  # [(offsets tuple, tensor)]


class ChunkSavePlanner(SavePlanner):
    def __init__(self, entries):
        self.entries = entries

    def set_up_planner(self, state_dict=None, storage_meta=None, is_coordinator=False, *args, **kwargs):
        self.is_coordinator = is_coordinator

    def create_local_plan(self):
        items, self._data = [], {}
        for fqn, e in self.entries.items():
            for offsets, t in e.chunks:
                index = MetadataIndex(fqn, offsets)
                self._data[index] = t
                items.append(WriteItem(
                    index=index, type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                                           sizes=t.shape),
                                                properties=TensorProperties(dtype=e.dtype),
                                                size=torch.Size(e.size))))
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans):
        plans, metadata = create_default_global_save_plan(all_plans, rewrite_index_hints=False)
        errors = _validate_global_plan(plans, metadata)
        if errors is False or (isinstance(errors, list) and errors):
            # Chunks that overlap or do not cover a tensor are a bug in the layout code.
            raise RuntimeError(f"megalite checkpoint: inconsistent chunk layout: {errors}")
        return plans, metadata

    def finish_plan(self, new_plan):
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item):
        return self._data[write_item.index]


class ChunkLoadPlanner(LoadPlanner):
    """Fill `entries` from the checkpoint; names absent from it raise unless listed in
    `optional` (those are reported in `self.missing`)."""

    def __init__(self, entries, optional=()):
        self.entries, self.optional, self.missing = entries, set(optional), []

    def set_up_planner(self, state_dict=None, metadata=None, is_coordinator=False, *args, **kwargs):
        self.metadata = metadata

    def create_local_plan(self):
        items = []
        saved = self.metadata.state_dict_metadata
        for fqn, e in self.entries.items():
            if fqn not in saved:
                if fqn in self.optional:
                    self.missing.append(fqn)
                    continue
                raise CheckpointError(f"the checkpoint has no tensor {fqn!r}: it was saved from another model")
            md = saved[fqn]
            if tuple(md.size) != tuple(e.size):
                raise CheckpointError(f"tensor {fqn!r} has shape {tuple(md.size)} in the checkpoint but "
                                      f"{tuple(e.size)} in this model")
            local = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in e.chunks]
            items += create_read_items_for_chunk_list(fqn, md, local)
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value):
        raise CheckpointError("unexpected non-tensor item in a megalite checkpoint")

    def resolve_tensor(self, read_item):
        _, t = self.entries[read_item.dest_index.fqn].chunks[read_item.dest_index.index]
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, read_item, tensor):
        pass  # resolve_tensor handed out a view of the destination: already in place
