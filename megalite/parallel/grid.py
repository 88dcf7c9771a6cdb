"""A parallel layout as a value: sizes, one rank's coordinates and its process groups (DESIGN.md,
"Process-group grid"). parallel_state builds the global one and keeps it; model code is handed one."""

from megalite.parallel.pipeline_stages import PipelineStages


class Grid:
    """One layout's sizes, this rank's coordinates and its groups (None where a group is not built: a
    single process, or a layout described for planning with Grid.of). Model code is handed one (its
    modules' `grid` argument; the training entry point passes the global one, current_grid())."""

    def __init__(self, tp, pp, dp, cp, vpp):
        self.tp, self.pp, self.dp, self.cp, self.vpp = tp, pp, dp, cp, vpp
        self.tp_group = self.pp_group = self.dp_group = self.mp_group = self.emb_group = None
        self.cp_group = self.dp_cp_group = self.tp_cp_group = None
        self.hcp = []  # --hierarchical-context-parallel-sizes: [(group, global ranks)] per level
        self.grad_nodes = None  # --hierarchical-grad-reduce: (this node's group, ranks; cross-node group, ranks)
        self.pp_before_dp = False  # --use-tp-pp-dp-mapping
        self.pipeline_placement = "loop"  # where the stages sit (pipeline_stages.py): "v" under --pipeline-schedule zbv
        self.tp_rank = self.pp_rank = self.dp_rank = self.cp_rank = 0
        self.pp_ranks = [0]
        self.emb_ranks = [0]
        self.cp_ranks = [0]
        self.virtual_rank = 0
        self.ep = 1  # expert grid (MoE): None until initialize_model_parallel gets an expert-parallel size
        self.experts = False
        self.ep_group = self.edp_group = self.emp_group = self.stage_group = self.etp_group = self.tp_ep_group = None
        self.ep_rank = self.etp_rank = 0
        self.etp = 1
        self.edp, self.edp_rank = dp * cp, 0
        # semi-synchronous replicas (--semi-sync-replicas): R model copies, each its own grid of `dp`
        # inner DP ranks; the replica group joins this rank's counterparts in the other replicas (the
        # outer step), the replica-world group all ranks of this replica (None where R = 1: the world)
        self.replicas, self.replica_rank = 1, 0
        self.replica_group = self.replica_world_group = None
        self.replica_world_ranks, self.replica_counterparts = None, []
        self.rank = 0  # global

    @classmethod
    def of(cls, tp=1, pp=1, dp=1, cp=1, vpp=None, ep=None, etp=None, tp_rank=0, pp_rank=0, dp_rank=0, cp_rank=0,
           placement="loop"):
        """A layout's grid without process groups: sizes and one rank's coordinates (the expert ones follow
        from them as in process_groups), to build that rank's model (on the meta device: a planner builds
        many layouts in one process)."""
        g = cls(tp, pp, dp, cp, vpp)
        g.pipeline_placement = placement
        g.tp_rank, g.pp_rank, g.dp_rank, g.cp_rank = tp_rank, pp_rank, dp_rank, cp_rank
        g.pp_ranks = list(range(pp))
        if ep is not None:
            etp = tp if etp is None else etp
            g.experts, g.ep, g.etp, g.edp = True, ep, etp, tp * cp * dp // (ep * etp)
            j = tp_rank + tp * (cp_rank + cp * dp_rank)  # the stage's dense order, re-read as ETP x EP x EDP
            g.etp_rank, g.ep_rank, g.edp_rank = j % etp, (j // etp) % ep, j // (etp * ep)
        return g

    def stages(self):
        """Where the pipeline's stages sit (PipelineStages: which rank and chunk runs each)."""
        return PipelineStages(self.pp, self.vpp or 1, self.pipeline_placement)

    def stage_of(self, chunk, pp_rank=None):
        """The pipeline stage this rank's (or pp_rank's) model chunk `chunk` runs."""
        return self.stages().stage(self.pp_rank if pp_rank is None else pp_rank, chunk)

    def first_stage(self):
        """This rank holds the pipeline's first stage (whatever its virtual chunk; the V: the last rank)."""
        return self.pp_rank == self.stages().holder(0)[0]

    def last_stage(self):
        """This rank holds the pipeline's last stage (whatever its virtual chunk)."""
        return self.pp_rank == self.pp - 1

    def world_size(self):
        """Every rank of the run: TP x CP x PP x DP x semi-synchronous replicas."""
        return self.tp * self.cp * self.pp * self.dp * self.replicas

    def data_rank(self):
        """This rank's DP index over every replica (replica x inner DP): what it reads of each global batch."""
        return self.dp_rank + self.dp * self.replica_rank

    def data_ranks(self):
        """How many parts each global batch is read in: inner DP x replicas."""
        return self.dp * self.replicas

    def tp_cp_rank(self):
        """This rank's index in its TP x CP group (TP fastest)."""
        return self.cp_rank * self.tp + self.tp_rank

    def dp_cp(self):
        """(group, size, rank) over DP x CP: where dense gradients are reduced and ZeRO shards them."""
        group = self.dp_cp_group if self.cp > 1 else self.dp_group
        return group, self.dp * self.cp, self.dp_rank * self.cp + self.cp_rank

    def expert_dp(self):
        """(group, size, rank) over expert-DP (DP x CP without an expert grid)."""
        return (self.edp_group, self.edp, self.edp_rank) if self.experts else self.dp_cp()

    def stage_dp_group(self, with_context_parallel=True):
        """TP x CP x DP: the ranks of one pipeline stage (an MoE job's; without an expert grid, TP = 1)."""
        if self.experts:
            return self.stage_group
        if self.tp > 1:
            raise RuntimeError("the tensor-and-data-parallel group is built with the expert grid "
                               "(initialize_model_parallel(..., expert_model_parallel_size=...))")
        return self.dp_cp()[0] if with_context_parallel else self.dp_group

    def expert_tp_group(self):
        return self.etp_group if self.experts else self.tp_group

    def expert_model_group(self):
        """The group of one expert's copies over ETP x EP x PP (TP x PP without an expert grid)."""
        return self.emp_group if self.experts else self.mp_group

    def expert_tp(self):
        """(size, rank) an MoE expert's weights are sharded over: expert-TP, or TP without an expert grid."""
        return (self.etp, self.etp_rank) if self.experts else (self.tp, self.tp_rank)

    def freeze(self):
        """From now on the grid is a value: parallel_state freezes the one it builds, so nothing it is handed to can
        change the run's layout. The virtual-pipeline rank stays settable: Megatron's accessor
        (set_virtual_pipeline_model_parallel_rank) and a model provider without vp_stage build chunk by chunk."""
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False) and name != "virtual_rank":
            raise AttributeError(f"Grid.{name} cannot change: the run's grid is a value once built "
                                 "(parallel_state.initialize_model_parallel builds a new one)")
        object.__setattr__(self, name, value)

    def __deepcopy__(self, memo):
        """Modules hold their grid: a copied model shares it (a handle on process groups, not model state)."""
        return self


def rank_of(tp_rank, dp_rank, pp_rank, tp, dp, cp_rank=0, cp=1, pp=1, pp_before_dp=False):
    """Global rank of a grid coordinate (Megatron's order: TP, CP, DP, PP; or TP, CP, PP, DP)."""
    if pp_before_dp:
        return tp_rank + tp * (cp_rank + cp * (pp_rank + pp * dp_rank))
    return tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
