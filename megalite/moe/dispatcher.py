"""Token dispatch between an MoE layer's router and its experts (Megatron-Core's token_dispatcher).

Experts are split over the expert-parallel (EP) group: EP rank r holds the L = E / EP experts
[r·L, (r+1)·L), each sharded over expert-TP (ETP: 1, or the TP size). A dispatcher takes this
rank's tokens [T, h] with their routing (probs and map [T, E]), gives the local experts their rows,
sorted by local expert (`counts[l]` rows for expert l), and combines the experts' outputs back into
[T, h]: Σ_e p_te · expert_e(token t). The experts' outputs are partial sums over ETP (their layers do
not communicate); the combine sums them. The probabilities are applied in the combine, on the rank
that owns the token, so the router's gradient never leaves it.
- allgather: every rank gathers the tokens and routing of its ETP x EP group, runs its experts on
  the rows routed to them, and the partial outputs are reduce-scattered back over ETP x EP (sends
  (ETP·EP-1)·T rows each way whatever the routing; no host-visible counts exchanged).
- alltoall: each rank sorts its (token, expert) pairs by expert and sends each EP rank exactly the
  rows its experts take (uneven splits, after an exchange of the counts); ETP ranks then share what
  they received (an uneven all-gather); the outputs return the same way, summed over ETP (sends
  T·k·(EP-1)/EP rows each way on average at ETP = 1).
At EP = ETP = 1 both are the same local permutation. Dropless unless the router dropped tokens.
"""

import torch

from megalite import parallel_state as ps
from megalite.distributed.ep_comm import (all_gather_rows, all_to_all_rows, exchange_counts, gather_counts,
                                          gather_uneven_rows, groups, reduce_scatter_rows,
                                          reduce_scatter_uneven_rows)


def local_experts(num_experts, grid=None):
    """(first global index, count) of this rank's experts (in `grid`, default the global one)."""
    grid = ps.current_grid(grid)
    ep = grid.ep
    if num_experts % ep:
        raise ValueError(f"--num-experts {num_experts} is not divisible by --expert-model-parallel-size {ep}")
    count = num_experts // ep
    return grid.ep_rank * count, count


def _permute(routing_map):
    """(token index of each routed row, sorted by expert then token; rows per expert [E] tensor)."""
    pairs = routing_map.t().nonzero()  # (expert, token), row-major: by expert, then token
    return pairs[:, 1], routing_map.sum(dim=0)


def _regroup(chunks, sources, count, device):
    """Rows arrive as `sources` blocks of `count` per-expert chunks (sizes `chunks`, source-major): the
    index that orders them by expert, then source, and its inverse."""
    starts = [0]
    for n in chunks[:-1]:
        starts.append(starts[-1] + n)
    order = [s * count + e for e in range(count) for s in range(sources)]
    index = torch.cat([torch.arange(starts[i], starts[i] + chunks[i]) for i in order]).to(device)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=device)
    return index, inverse


class TokenDispatcher:
    def __init__(self, num_experts, kind="allgather", grid=None):
        self.num_experts, self.kind = num_experts, kind
        self.first, self.count = local_experts(num_experts, grid)
        self.grid = ps.current_grid(grid)
        self.g = groups(self.grid)
        self.gathered = self.kind == "allgather" or self.g["ep"][1] == 1
        self.source_ranks = None  # each source's data rank (sources(): FP8 experts)

    def dispatch(self, tokens, probs, routing_map):
        """-> (rows [N, h] sorted by local expert, counts [L] as ints)."""
        self.num_tokens = tokens.shape[0]
        if self.gathered:
            return self._dispatch_gathered(tokens, probs, routing_map)
        return self._dispatch_all_to_all(tokens, probs, routing_map)

    def combine(self, rows):
        """The experts' outputs [N, h] (dispatch's order; partial over ETP) -> [T, h], weighted by the
        probabilities."""
        # the weights hang on this forward's graph: kept past it, they would keep the graph, and the process
        # groups its nodes name, alive as long as the model (a process building many models kept every grid's)
        weights, self.weights = self.weights, None
        if self.gathered:
            return reduce_scatter_rows(self._unpermute(rows, weights, self.num_tokens * self.g["tp_ep"][1]),
                                       self.g["tp_ep"])
        back = rows[self.inverse] if self.inverse is not None else rows
        back = reduce_scatter_uneven_rows(back, self.peer_rows, self.g["etp"])
        back = all_to_all_rows(back, self.send, self.recv, self.g["ep"])
        return self._unpermute(back, weights, self.num_tokens)

    def _unpermute(self, rows, weights, num_tokens):
        weighted = rows * weights.unsqueeze(1).to(rows.dtype)
        return rows.new_zeros((num_tokens, rows.shape[1])).index_add(0, self.token_index, weighted)

    def _dispatch_gathered(self, tokens, probs, routing_map):
        lo, hi, g = self.first, self.first + self.count, self.g["tp_ep"]
        tokens = all_gather_rows(tokens, g)
        # every rank's routing over all experts (an all-gather sends the sender's rows), then our columns
        probs = all_gather_rows(probs, g)[:, lo:hi]
        local_map = all_gather_rows(routing_map.to(torch.uint8), g).bool()[:, lo:hi]  # (gloo gathers no bool)
        self.token_index, counts = _permute(local_map)
        self.arrived = None
        expert = torch.repeat_interleave(torch.arange(self.count, device=counts.device), counts)
        self.weights = probs[self.token_index, expert]
        return tokens[self.token_index], counts.tolist()

    def _dispatch_all_to_all(self, tokens, probs, routing_map):
        ep, etp, n = self.g["ep"][1], self.g["etp"][1], self.count
        self.token_index, per_expert = _permute(routing_map)  # every global expert, in EP-rank order
        expert = torch.repeat_interleave(torch.arange(self.num_experts, device=per_expert.device), per_expert)
        self.weights = probs[self.token_index, expert]
        received = exchange_counts(per_expert, self.g["ep"])  # [EP, L]: source rank s -> my expert l
        every = gather_counts(received.flatten(), self.g["etp"]).view(etp * ep, n)  # and my ETP peers'
        sizes = torch.cat([per_expert.view(ep, n).sum(1), received.sum(1), every.view(etp, -1).sum(1),
                           every.sum(0), every.flatten()]).tolist()  # the one host read of the dispatch
        self.send, self.recv, self.peer_rows = sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:2 * ep + etp]
        counts, chunks = sizes[2 * ep + etp:2 * ep + etp + n], sizes[2 * ep + etp + n:]
        rows = all_to_all_rows(tokens[self.token_index], self.recv, self.send, self.g["ep"])
        rows = gather_uneven_rows(rows, self.peer_rows, self.g["etp"])
        # arrived ordered (ETP peer, source, local expert); the experts want (local expert, ...)
        self.inverse, self.arrived = None, (chunks, None)
        if n > 1:
            index, self.inverse = _regroup(chunks, etp * ep, n, tokens.device)
            rows, self.arrived = rows[index], (chunks, index)
        return rows, counts

    def sources(self):
        """The micro-batch each row of the last dispatch belongs to, as an index into the sorted data ranks of the
        ranks it gathers rows from (FP8 experts scale each micro-batch's rows as one process does,
        megalite/moe/experts.py), and how many there are. The first call gathers those ranks' data ranks (every
        rank dispatches at once): each micro-batch's TP x CP ranks must all be among them."""
        if self.source_ranks is None:
            mine = torch.tensor([self.grid.data_rank()], device=self.token_index.device)
            ranks = all_gather_rows(mine, self.g["tp_ep"]) if self.gathered else \
                all_gather_rows(all_gather_rows(mine, self.g["ep"]), self.g["etp"])  # (arrival order: ETP peer, EP)
            share = self.grid.tp * self.grid.cp
            if int((ranks == mine).sum()) != share:
                raise ValueError(f"FP8 MoE experts: an expert gets the tokens of {int((ranks == mine).sum())} of the "
                                 f"{share} TP x CP ranks that share a micro-batch, so it cannot scale that "
                                 "micro-batch's rows whole; use --expert-tensor-parallel-size equal to TP or a larger "
                                 "--expert-model-parallel-size")
            distinct = torch.unique(ranks)  # (sorted)
            self.source_ranks = (torch.searchsorted(distinct, ranks), distinct.numel())
        of_source, count = self.source_ranks
        if self.arrived is None:  # gathered: row r of the gathered tokens came from source r // T
            return of_source[torch.div(self.token_index, self.num_tokens, rounding_mode="floor")], count
        chunks, index = self.arrived  # (source, local expert)-major chunks as they arrived
        chunk_source = torch.arange(len(chunks), device=of_source.device) // self.count
        src = torch.repeat_interleave(of_source[chunk_source], torch.tensor(chunks, device=of_source.device))
        return (src if index is None else src[index]), count
