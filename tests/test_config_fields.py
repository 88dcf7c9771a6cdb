"""ModelConfig's fields declare what they are once (megalite/config/model.py, Field): the flag they come from,
whether they
shape the model's tensors (a checkpoint must agree: SHAPE_FIELDS), whether they describe the run's layout (reset for
a one-process rebuild: LAYOUT_FIELDS), whether --use-checkpoint-args restores them (CHECKPOINT_ARGS). The lists are
derived; what keeps the declarations honest is measured here: every field whose change changes a parameter's name
or shape in a built model is a shape field."""

import dataclasses
import typing

import pytest
import torch

from megalite import parallel_state as ps
from megalite.config import CHECKPOINT_ARGS, FLAG_FIELDS, LAYOUT_FIELDS, SHAPE_FIELDS, ConfigError, ModelConfig
from megalite.models import GPTModel

# the families whose fields are live: a dense GPT; DeepSeek-V3's shape (MoE with a shared expert, MLA with DSA's
# indexer, one MTP depth)
DENSE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
             make_vocab_size_divisible_by=8)
DEEPSEEK = dict(DENSE, num_layers=3, num_moe_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1, 1],
                moe_shared_expert_intermediate_size=16, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8,
                qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, position_embedding_type="rope",
                normalization="RMSNorm", add_bias_linear=False, mtp_num_layers=1,
                experimental_attention_variant="dsa", dsa_indexer_n_heads=2, dsa_indexer_head_dim=8,
                dsa_indexer_topk=4)
# what a field's change can be: strings from their meanings, numbers doubled or set, booleans flipped
STRINGS = {"position_embedding_type": ["rope", "learned_absolute"], "normalization": ["RMSNorm", "LayerNorm"],
           "layernorm_position": ["post"], "gelu": ["exact"], "rope_type": ["rope", "yarn"],
           "moe_router_score_function": ["sigmoid"], "moe_token_dispatcher_type": ["alltoall"],
           "experimental_attention_variant": ["dsa", None]}
# fields that change a shape which the checkpoint itself accounts for, each for its reason
SHAPED_ELSEWHERE = {
    "make_vocab_size_divisible_by": "vocabulary padding: checkpoints hold the real rows only "
                                    "(checkpoint/layout.py), as "
                                    "another TP pads otherwise too",
    "max_position_embeddings": "learned positions' table: checked where it shapes it (checkpointing._check_compatible)",
    "seq_length": "only through max_position_embeddings' default"}
NOT_TRIED = {"model_type": "another model class (BertModel), chosen by the entry point, not by this build",
             "params_dtype": "a dtype, not a shape", "moe_layer_freq": "tried as lists below"}


def _candidates(name, value, kind):
    if name in STRINGS:
        return [v for v in STRINGS[name] if v != value]
    if name == "moe_layer_freq":
        return [[1, 1, 1], [0, 0, 1]]
    if kind is bool or isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value * 2, value + 1, 0]
    if isinstance(value, float):
        return [value * 0.5, value + 1.0]
    if value is None:
        return [1, 2, 4, 8, 16, 0.5]
    return []


def _shapes(cfg):
    with ps.meta_init():
        model = GPTModel(cfg, pre_process=True, post_process=True)
    return {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def _base_type(name):
    hint = typing.get_type_hints(ModelConfig)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


@pytest.mark.parametrize("family", [DENSE, DEEPSEEK], ids=["dense", "deepseek"])
def test_every_field_that_changes_a_shape_is_a_shape_field(grid, family):
    base = ModelConfig(**family)
    want, found, tried = _shapes(base), {}, set()
    for f in dataclasses.fields(ModelConfig):
        if f.name in NOT_TRIED:
            continue
        for value in _candidates(f.name, getattr(base, f.name), _base_type(f.name)):
            try:
                cfg = ModelConfig(**{**family, f.name: value})
                got = _shapes(cfg)
            except (ConfigError, ValueError, AssertionError, TypeError, ZeroDivisionError, IndexError, RuntimeError):
                continue  # not a valid model with this value
            tried.add(f.name)
            if got != want:
                found[f.name] = value
                break
    print(f"\n{len(tried)} fields changed and built; shapes moved with {sorted(found)}")
    unmarked = set(found) - set(SHAPE_FIELDS) - set(SHAPED_ELSEWHERE)
    assert found and not unmarked, \
        f"fields that change tensor shapes but are not shape fields (config.Field(shape=True)): {sorted(unmarked)}"


def test_the_derived_lists():
    """The lists the checkpoint code reads come from the declarations: the layout fields reset to their defaults,
    every restored field's flag exists on the command line, and no field is both shape and layout."""
    from megalite.cli.parser import parse_args
    args = parse_args("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
                      "--lr 1e-3 --train-iters 1 --mock-data".split(), world_size=1)
    assert "sequence_parallel" in LAYOUT_FIELDS and LAYOUT_FIELDS["sequence_parallel"] is False
    assert not set(LAYOUT_FIELDS) & set(SHAPE_FIELDS)
    assert all(hasattr(args, dest) for dest in CHECKPOINT_ARGS), [d for d in CHECKPOINT_ARGS if not hasattr(args, d)]
    assert all(hasattr(args, dest) for dest in FLAG_FIELDS.values()), \
        [d for d in FLAG_FIELDS.values() if not hasattr(args, d)]
    assert (CHECKPOINT_ARGS["num_experts"] == "num_moe_experts"
            and CHECKPOINT_ARGS["norm_epsilon"] == "layernorm_epsilon")
