"""Every field of a Hugging Face config.json accounted for (DESIGN.md: foreign formats are read field by field).

An architecture's check_hf and model_config read the fields they represent, each mapped or refused there; the
reads are recorded (Consulted), and what is left must be one of: how a model is served, labelled or generated
(SERVING, any value), a training setting that megalite takes from its own flags (TRAINING: named in one printed
line when it is set), a field the architecture declares inert (its `inert(h)`: a sliding window that is switched
off, a head that the causal-LM class does not build), or empty (None, {}, []: HF's "not used"). Any other field
is refused in one line naming it: a value megalite would not read is a model it would not build."""

from megalite.checkpoint.storage import CheckpointError

# PretrainedConfig's own fields and what older files still carry: serving, labels, generation, bookkeeping. None of
# them changes what the network computes from token ids.
SERVING = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "id2label",
    "label2id", "problem_type", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
    "use_cache", "chunk_size_feed_forward", "is_encoder_decoder", "tie_encoder_decoder", "tokenizer_class",
    "prefix", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "finetuning_task", "use_bfloat16", "tf_legacy_loss", "gradient_checkpointing",
    "pretraining_tp",  # (Llama: the same products, summed in slices)
    "output_router_logits", "_attn_implementation", "attn_implementation", "_attn_implementation_autoset",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "cross_attention_hidden_size",
    "initializer_range",  # (how a fresh model is drawn; an import brings the weights)
})
# Training settings: megalite's run takes them from its own flags, so an import names them instead of carrying them.
TRAINING = {"attn_pdrop": "--attention-dropout", "embd_pdrop": "--hidden-dropout", "resid_pdrop": "--hidden-dropout",
            "attention_dropout": "--attention-dropout", "router_aux_loss_coef": "--moe-aux-loss-coeff",
            "classifier_dropout": None, "summary_first_dropout": None}


class Consulted(dict):
    """A config (nested dicts included) that records which fields were read: `seen` holds their dotted paths."""

    def __init__(self, d, seen=None, prefix=""):
        super().__init__(d)
        self.seen, self.prefix = (set() if seen is None else seen), prefix

    def _wrap(self, key, value):
        self.seen.add(self.prefix + key)
        return Consulted(value, self.seen, f"{self.prefix}{key}.") if isinstance(value, dict) else value

    def __getitem__(self, key):
        return self._wrap(key, super().__getitem__(key))

    def get(self, key, default=None):
        return self._wrap(key, super().get(key, default))

    def __contains__(self, key):
        self.seen.add(self.prefix + key)
        return super().__contains__(key)


def _leaves(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and v and prefix + k not in SERVING:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield prefix + k, v


def read_hf_config(h, arch, name):
    """The megalite model config of HF config `h` under `arch` (its check_hf, model_config and, if it has one,
    inert(h) -> fields that do not matter in this config); CheckpointError naming any field left unread."""
    seen = Consulted(h)
    arch.check_hf(seen)
    cfg = arch.model_config(seen)
    inert = set(arch.inert(h)) if hasattr(arch, "inert") else set()
    left, named = [], []
    for path, value in _leaves(h):
        top = path.split(".")[0]
        if path in seen.seen or top in SERVING or path in inert or value in (None, {}, []):
            continue
        if path in TRAINING:
            if value:
                flag = TRAINING[path]
                named.append(f"{path}={value!r}" + (f" (set {flag})" if flag else ""))
            continue
        left.append(f"{path}={value!r}")
    if left:
        raise CheckpointError(f"{name} config field{'s' if len(left) > 1 else ''} {', '.join(left)} not represented "
                              f"in megalite's {arch.hf_class} table: refused rather than imported as another model")
    if named:
        print(f"convert: training settings of {name} not carried into the checkpoint: {', '.join(named)}",
              flush=True)
    return cfg
