"""Save / load / resume training at any topology (Megatron's layout, DCP underneath).

    DIR/latest_checkpointed_iteration.txt     the newest complete checkpoint ("10", or "release")
    DIR/iter_0000010/megalite.json            readable metadata: model config, parallel sizes, dtype,
                                              iteration, consumed samples, scheduler, loss scaler, version
    DIR/iter_0000010/tensors.json + __<r>_0.safetensors   global tensors (checkpoint/storage.py)
    DIR/iter_0000010/rng/rank_<r>.json        each rank's RNG states
    DIR/iter_0000010/checksums.json           every file's size and xxh3 checksum (checkpoint/integrity.py)

A save writes into DIR/iter_0000010.tmp, fsyncs every file, renames the directory once
every rank has written, and only then rewrites the tracker (via a renamed temporary
file): a crash at any moment leaves the previous checkpoint the newest complete one.
With --async-save the tensors are copied to host memory and written by a background
thread (DCP over a gloo group of its own); the next save, or the end of training, waits.
A failed save (a full disk) removes its partial directory (checkpoint/commit.py). A load verifies the
checksums first; a checkpoint that fails them is skipped for the newest earlier one that passes, said in one line
(--no-checkpoint-fallback: the run stops instead).
"""

import dataclasses
import json
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megalite import __version__
from megalite import parallel_state as ps
from megalite.checkpoint.commit import (  # noqa: F401  (TRACKER, read_tracker, iteration_dir: read here by tools)
    TRACKER, CommittingWriter, agreed_writes, iteration_dir, read_tracker, removing_partial, unwrap_checkpoint_error)
from megalite.checkpoint.integrity import newest_verified, verify_checksums, written
from megalite.checkpoint.planner import ChunkLoadPlanner, ChunkSavePlanner
from megalite.checkpoint.writer import CheckpointIO
from megalite.checkpoint.state import (
    main_params_from_model,
    model_entries,
    model_from_main_params,
    optimizer_entries,
    optimizer_step,
    outer_momentum_entries,
    fp8_state,
    rng_state,
    set_optimizer_step,
    set_fp8_state,
    set_rng_state,
)
from megalite.config import LAYOUT_FIELDS, SHAPE_FIELDS  # noqa: F401  (SHAPE_FIELDS: read here by tools)
from megalite.checkpoint.storage import (
    CheckpointError,
    SafetensorsReader,
    read_json,
    validate_files,
)

META = "megalite.json"
FORMAT = "megalite-checkpoint"


def optimizer_kind(cfg):
    """What the saved optimizer state is (Muon's scalar parameters have their own optimizer's state)."""
    return f"muon+{cfg.muon_scalar_optimizer}" if cfg.optimizer == "muon" else cfg.optimizer


def config_json(config):
    d = dataclasses.asdict(config)
    d["params_dtype"] = str(d["params_dtype"]).replace("torch.", "")
    return d


def config_for_one_process(saved):
    """The ModelConfig of a checkpoint's model_config (its JSON dict) for a model built whole on one process's
    TP group (generation, logits): unknown fields dropped, the training layout's own fields reset (a pipeline
    layout's per-stage layer counts would otherwise build only the first stage's layers)."""
    from megalite.config import ModelConfig
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = {k: v for k, v in saved.items() if k in names}
    cfg.update(LAYOUT_FIELDS, params_dtype=getattr(torch, cfg.get("params_dtype", "float32")))
    return ModelConfig(**cfg)


def _dcp(fn, *args, **kw):
    """DCP call; on one process (no groups) DCP warns that it assumes one process: it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kw)


def check_save_dir(root):
    """Fail early (every rank, one line) on a --save directory that cannot be written."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--save {root} is a file, not a directory")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"--save {root} cannot be created ({e.strerror})") from None
    if not os.access(root, os.W_OK):
        raise CheckpointError(f"--save {root} is not writable")


def save_checkpoint(iteration, chunks, optimizer, scheduler, model_config, cfg, consumed_train, consumed_valid, *,
                    io):
    """Every rank calls this at the same iteration (cfg: the CheckpointConfig, config/checkpoint.py; io: the run's
    CheckpointIO, checkpoint/writer.py)."""
    io.wait()
    for c in chunks:
        c.finish_param_sync()  # --overlap-param-gather: parameters must be whole
    g = ps.grid_of(chunks)
    root, rank = cfg.save, g.rank
    tmp = iteration_dir(root, iteration) + ".tmp"
    group = io.group()
    writer = CommittingWriter(tmp, root, iteration, cfg.verify_integrity, cfg.save_retain_interval)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed save's leftovers
    def _write_rank_files():
        if not cfg.no_save_rng:
            written(writer.sums, tmp, f"rng/rank_{rank:05d}.json", json.dumps(rng_state()).encode())
        # delayed FP8 scaling's amax histories (as TE's modules keep them in the model; each replica its own)
        if fp8 := {_replica_prefix(g) + n: h for n, h in fp8_state(chunks).items()}:
            written(writer.sums, tmp, f"fp8/rank_{rank:05d}.json", json.dumps(fp8).encode())

    def _write_meta():
        os.makedirs(os.path.join(tmp, "rng"))
        os.makedirs(os.path.join(tmp, "fp8"))
        meta = {"format": FORMAT, "version": 1, "megalite_version": __version__, "iteration": iteration,
                "consumed_train_samples": consumed_train, "consumed_valid_samples": consumed_valid,
                "model_config": config_json(model_config), "dtype": config_json(model_config)["params_dtype"],
                "parallel": {"tensor_model_parallel_size": g.tp, "pipeline_model_parallel_size": g.pp,
                             "data_parallel_size": g.dp,  # (per replica)
                             "semi_sync_replicas": g.replicas, "context_parallel_size": g.cp,
                             "use_tp_pp_dp_mapping": g.pp_before_dp, "virtual_pipeline_model_parallel_size": g.vpp,
                             "use_distributed_optimizer": bool(cfg.use_distributed_optimizer),
                             "zero_stage": cfg.zero_stage, "world_size": g.world_size()},
                "has_optimizer": not cfg.no_save_optim, "has_rng": not cfg.no_save_rng,
                "optimizer": {"step": optimizer_step(optimizer), "kind": optimizer_kind(cfg)},
                "semi_sync": semi.state() if (semi := getattr(optimizer, "semi_sync", None)) else None,
                "scheduler": scheduler.state_dict(), "loss_scaler": optimizer.scaler.state_dict(),
                "tokenizer": {"type": cfg.tokenizer_type, "model": cfg.tokenizer_model,
                              "vocab_file": cfg.vocab_file, "merge_file": cfg.merge_file},
                **_carried_source(cfg.load)}
        written(writer.sums, tmp, META, json.dumps(meta, indent=1).encode())
    agreed_writes(lambda: rank == 0 and _write_meta(), tmp, root, group)  # (the others write into its folders)
    agreed_writes(_write_rank_files, tmp, root, group)
    entries = model_entries(chunks, for_save=True)
    if not cfg.no_save_optim:  # each semi-synchronous replica its own inner state, the first the outer one
        entries.update(optimizer_entries(optimizer, chunks, for_save=True, prefix=_replica_prefix(g)))
        entries.update(outer_momentum_entries(optimizer, chunks, for_save=True))
    kw = dict(storage_writer=writer, planner=ChunkSavePlanner(entries), process_group=group, no_dist=group is None)
    if not cfg.async_save:
        return removing_partial(lambda: _dcp(dcp.save, {}, **kw), tmp, root, group)
    for e in entries.values():  # training goes on mutating these: write host copies
        e.chunks = [(o, t.detach().to("cpu", copy=True)) for o, t in e.chunks]
    io.submit(removing_partial, lambda: _dcp(dcp.save, {}, **kw), tmp, root, group)


def _check_compatible(meta, model_config, path):
    saved = meta.get("model_config", {})
    mine = config_json(model_config)
    for f in SHAPE_FIELDS:
        if f in saved and saved[f] != mine[f]:
            flag = {"model_type": "pretrain_gpt.py / pretrain_bert.py", "gelu": "--openai-gelu",
                    "num_tokentypes": "the entry point"}.get(f, "--" + f.replace("_", "-"))
            raise CheckpointError(f"checkpoint {path} was saved with {f}={saved[f]} but this run has {f}={mine[f]}; "
                                  f"use the checkpoint's model flags ({flag})")
    if mine["position_embedding_type"] == "learned_absolute" and \
            saved.get("max_position_embeddings") != mine["max_position_embeddings"]:
        raise CheckpointError(f"checkpoint {path} has --max-position-embeddings {saved.get('max_position_embeddings')}"
                              f" but this run has {mine['max_position_embeddings']}")


def load_checkpoint(chunks, optimizer, scheduler, model_config, cfg, root=None, *, io):
    """Returns (iteration, consumed_train, consumed_valid), or None when --load holds no
    checkpoint (training starts from scratch, as in Megatron). cfg: the CheckpointConfig. io: the run's
    CheckpointIO (checkpoint/writer.py)."""
    root = cfg.load if root is None else root
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--load {root} is a file; give the checkpoint directory (the one holding {TRACKER})")
    it = read_tracker(root) if os.path.isdir(root) else None
    g = ps.grid_of(chunks)
    if it is None:
        if g.rank == 0:
            print(f"megalite: no checkpoint in --load {root}; training from scratch", flush=True)
        return None
    group = io.group()
    say = (lambda m: print(m, flush=True)) if g.rank == 0 else (lambda m: None)
    it, path = newest_verified(_candidates(root, it), group, cfg.verify_integrity, not cfg.no_checkpoint_fallback,
                               say)
    meta = read_json(os.path.join(path, META), "checkpoint metadata")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{os.path.join(path, META)} is not a megalite checkpoint's metadata")
    _check_compatible(meta, model_config, path)
    release = it == "release"
    weights_only = release or cfg.finetune
    load_optim = not (weights_only or cfg.no_load_optim) and meta.get("has_optimizer", False)
    saved_kind = (meta.get("optimizer") or {}).get("kind", "adam")
    if load_optim and saved_kind != optimizer_kind(cfg):
        raise CheckpointError(f"{path} holds the optimizer state of --optimizer {saved_kind}, this run uses "
                              f"--optimizer {optimizer_kind(cfg)}: add --no-load-optim to load the weights only "
                              "(the optimizer starts fresh)")
    entries = model_entries(chunks, for_save=False)
    optional = set()
    if load_optim:  # a replica the checkpoint has not (another count, or a synchronous run) takes the first's
        saved = (meta.get("parallel") or {}).get("semi_sync_replicas", 1)
        prefix = _replica_prefix(g) if g.replica_rank < saved else ""
        opt = optimizer_entries(optimizer, chunks, for_save=False, prefix=prefix)
        optional = {k for k in opt if k.startswith(f"{prefix}optimizer.main_param.")}  # absent in fp32 checkpoints
        momentum = outer_momentum_entries(optimizer, chunks, for_save=False)
        optional |= set(momentum)  # a synchronous (or Local SGD) checkpoint has none: the momentum starts at 0
        entries.update(opt)
        entries.update(momentum)
    validate_files(path)  # a corrupt or foreign file: one clean line on every rank, before DCP
    planner = ChunkLoadPlanner(entries, optional)
    _dcp(dcp.load, {}, storage_reader=SafetensorsReader(path), planner=planner, process_group=group,
         no_dist=group is None)
    _drop_gathered(chunks)
    if load_optim:
        set_optimizer_step(optimizer, chunks, meta["optimizer"]["step"])
        mains = {k for k in optional if ".main_param." in k}
        if mains and not mains & set(planner.missing):
            model_from_main_params(optimizer)
        else:
            main_params_from_model(optimizer)
        scheduler.load_state_dict(meta["scheduler"])
        optimizer.scaler.load_state_dict(meta["loss_scaler"])
    else:
        main_params_from_model(optimizer)
    _load_rng_states(meta, path, cfg, weights_only, g)
    fp8_dir = os.path.join(path, "fp8")
    if os.path.isdir(fp8_dir):  # every rank's histories, merged by module name: any layout takes its own
        saved = (meta.get("parallel") or {}).get("semi_sync_replicas", 1)  # (another count: the first replica's)
        set_fp8_state(chunks, {k: v for f in sorted(os.listdir(fp8_dir))
                               for k, v in read_json(os.path.join(fp8_dir, f), "FP8 state").items()},
                      _replica_prefix(g) if g.replica_rank < saved else "")
    if load_optim and getattr(optimizer, "fp8_gather", None) is not None:  # --fp8-param-gather: the FP8 weights
        optimizer.publish_main_params()  # from the loaded main weights and histories, as after the saved step
    if getattr(optimizer, "semi_sync", None) is not None:  # saved at an outer step: the weights are global
        optimizer.semi_sync.loaded(meta.get("semi_sync"), [k for k in planner.missing if k.startswith("semi_sync.")])
    if weights_only:
        return 0, 0, 0
    return meta["iteration"], meta["consumed_train_samples"], meta["consumed_valid_samples"]


def _carried_source(load):
    """{"source": ...} of the Hugging Face class the --load checkpoint was imported from (read from its newest
    checkpoint, which carried it from its own --load), so that training's checkpoints export back as that class;
    {} where there is none (a model made here, a Megatron-LM one, nothing loaded)."""
    try:
        it = read_tracker(load) if load and os.path.isdir(load) else None
        meta = read_json(os.path.join(iteration_dir(load, it), META), "checkpoint metadata") if it else None
    except CheckpointError:
        return {}
    source = meta.get("source") if isinstance(meta, dict) else None
    hf = source.get("hf_class") if isinstance(source, dict) else None
    return {"source": {"hf_class": hf, "path": source.get("path")}} if isinstance(hf, str) else {}


def _candidates(root, it):
    """[(iteration, directory)] to load from, newest first: the tracker's, then every earlier complete one."""
    if it == "release":
        return [(it, iteration_dir(root, it))]
    earlier = sorted((int(n[5:]) for n in os.listdir(root) if n.startswith("iter_") and n[5:].isdigit()
                      and int(n[5:]) < it and os.path.isdir(os.path.join(root, n))), reverse=True)
    return [(i, iteration_dir(root, i)) for i in [it] + earlier]


def _replica_prefix(grid):
    """Checkpoint names of this semi-synchronous replica's inner optimizer state (the first's are the
    ordinary ones, which a synchronous run loads)."""
    r = grid.replica_rank
    return f"replica{r}." if r else ""


def load_weights(chunks, root):
    """Only the model weights of the newest checkpoint under `root` (e.g. for inference; every rank calls it);
    returns its metadata."""
    it = read_tracker(root) if os.path.isdir(root) else None
    if it is None:
        raise CheckpointError(f"{root} holds no checkpoint ({TRACKER} is missing)")
    path = iteration_dir(root, it)
    verify_checksums(path)
    meta = read_json(os.path.join(path, META), "checkpoint metadata")
    validate_files(path)
    io = CheckpointIO()
    try:
        group = io.group()
        _dcp(dcp.load, {}, storage_reader=SafetensorsReader(path),
             planner=ChunkLoadPlanner(model_entries(chunks, False)), process_group=group, no_dist=group is None)
    except CheckpointException as e:
        raise unwrap_checkpoint_error(e) from None
    finally:
        io.close()
    _drop_gathered(chunks)
    return meta


def _drop_gathered(chunks):
    """ZeRO-3 loads into the shards: any gathered copy is stale (re-gathered when next used)."""
    for c in chunks:
        if getattr(c, "units", None) is not None:
            c.units.release_all()


def _load_rng_states(meta, path, cfg, weights_only, g):
    if weights_only or cfg.no_load_rng:
        return
    par = meta.get("parallel", {})
    # Per-rank streams belong to grid coordinates: the same TP, CP, PP, world and rank order.
    same = (par.get("tensor_model_parallel_size"), par.get("pipeline_model_parallel_size"),
            par.get("context_parallel_size", 1), par.get("use_tp_pp_dp_mapping", False),
            par.get("world_size")) == (g.tp, g.pp, g.cp, g.pp_before_dp, g.world_size())
    if not (same and meta.get("has_rng")):
        if g.rank == 0 and "megatron" not in meta.get("source", {}):  # (a Megatron-LM directory's: from_megatron)
            print("megalite: checkpoint RNG states not restored (saved at another layout or without them); "
                  "random streams restart from --seed", flush=True)
        return
    set_rng_state(read_json(os.path.join(path, "rng", f"rank_{g.rank:05d}.json"), "RNG state"))
