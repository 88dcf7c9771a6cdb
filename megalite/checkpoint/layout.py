"""Where each local tensor sits in its global (TP=1, unpadded) tensor.

A parameter's global name is its name in the model (global layer numbers), and its global
shape is the TP=1 shape with the vocabulary cut to the real vocabulary: padding rows
depend on TP, are zero and never learn, so they are not stored. SwiGLU's fc1 ([gate; up],
sharded blockwise) is stored as [2, ffn, ...] so a TP shard is one box in it. A local
flat range (a ZeRO piece) becomes a few boxes that are each contiguous in memory.
"""

import math

from megalite.distributed.param_facts import first_replica, tensor_parallel

TIED_NAME = "embedding.word_embeddings.weight"


class ParamLayout:
    """view_shape: the local tensor seen in the global tensor's rank; offset: where it sits;
    rows: the real length of dim 0 (vocabulary) or None; owner: whether this rank writes
    it (replicated tensors are written by TP rank 0 only)."""

    def __init__(self, name, param):
        tp, r, _ = tensor_parallel(param)  # (an expert's: expert-TP)
        shape = tuple(param.shape)
        self.tied_copy = bool(getattr(param, "shared_embedding", False))
        self.name = TIED_NAME if self.tied_copy else name
        self.rows = getattr(param, "real_vocab_size", None)
        chunks = getattr(param, "shard_chunks", 1)
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            dim = param.partition_dim
            if chunks > 1:  # [c * k, ...] -> [c, k, ...], sharded on dim 1
                self.view_shape = (chunks, shape[0] // chunks) + shape[1:]
                dim = 1
            else:
                self.view_shape = shape
            self.global_shape = tuple(n * tp if d == dim else n for d, n in enumerate(self.view_shape))
            self.offset = tuple(r * n if d == dim else 0 for d, n in enumerate(self.view_shape))
            self.owner = True
        else:
            self.view_shape = (chunks, shape[0] // chunks) + shape[1:] if chunks > 1 else shape
            self.global_shape, self.offset = self.view_shape, (0,) * len(self.view_shape)
            self.owner = r == 0
        if self.rows is not None:
            self.global_shape = (self.rows,) + self.global_shape[1:]
        self.owner = self.owner and not self.tied_copy  # the first stage's copy is the one stored
        self.first_replica = first_replica(param)  # over DP x CP (experts: expert-DP)

    def boxes(self, start, end):
        """[(global offsets, sizes, flat begin)] for the local flat range [start, end), cut
        to the real vocabulary."""
        out = []
        for off, size, flat in flat_to_boxes(start, end, self.view_shape):
            g = tuple(o + s for o, s in zip(off, self.offset))
            if self.rows is not None:
                if len(size) and g[0] >= self.rows:
                    continue
                # A box of several rows spans whole rows, so cutting rows keeps it contiguous.
                size = (min(size[0], self.rows - g[0]),) + tuple(size[1:])
            out.append((g, tuple(size), flat))
        return out

    def chunks(self, flat_tensor, start=0, end=None):
        """[(global offsets, view)] of `flat_tensor`, which holds local elements [start, end)."""
        end = start + flat_tensor.numel() if end is None else end
        return [(g, flat_tensor[f - start:f - start + math.prod(size)].view(size))
                for g, size, f in self.boxes(start, end)]


def flat_to_boxes(start, end, shape):
    """Split the row-major flat range [start, end) of `shape` into boxes, each contiguous in
    memory: [(offsets, sizes, flat begin)]."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,), start)] if shape else [((), (), 0)]
    inner = math.prod(shape[1:])
    boxes, a = [], start // inner
    if start % inner:  # a partial first row
        stop = min(end, (a + 1) * inner)
        boxes += [((a,) + o, (1,) + s, f + a * inner) for o, s, f in flat_to_boxes(start - a * inner,
                                                                                      stop - a * inner, shape[1:])]
        a += 1
        if stop == end:
            return boxes
    b = end // inner
    if b > a:  # whole rows
        boxes.append(((a,) + (0,) * (len(shape) - 1), (b - a,) + tuple(shape[1:]), a * inner))
    if end % inner:  # a partial last row
        boxes += [((b,) + o, (1,) + s, f + b * inner) for o, s, f in flat_to_boxes(0, end - b * inner, shape[1:])]
    return boxes
