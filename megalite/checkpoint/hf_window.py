"""Sliding-window attention between Hugging Face configs and megalite's --window-size / --window-attn-skip-freq
(transformer/attention.py). HF's sliding_window W is the keys a query sees, itself included (transformers' mask:
key j visible from query i while i - j < W): megalite's window, the keys before it, is W - 1. Where a config says
which layers window (layer_types; Qwen's use_sliding_window with max_window_layers, the layers from which on it
windows), megalite takes every layer windowed, or every N-th layer global (--window-attn-skip-freq N); any other
pattern is refused in one line, never imported as full attention."""

from megalite.checkpoint.storage import CheckpointError

WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM")  # the classes an export writes one to


def window_fields(h):
    """{window_size, window_attn_skip_freq} of an HF config ({} for full attention everywhere)."""
    window, types, layers = h.get("sliding_window"), list(h.get("layer_types") or []), h["num_hidden_layers"]
    start = h.get("max_window_layers", 0)  # (read either way: hf_fields counts it accounted for, inert when off)
    on = h.get("use_sliding_window") if "use_sliding_window" in h else window is not None
    if on and not types and "use_sliding_window" in h:  # (Qwen: the layers from max_window_layers on window; none
        # given: every layer, as a Mixtral megalite wrote says)
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    if not on or window is None:
        if any(t != "full_attention" for t in types):
            raise CheckpointError(f"{h.get('model_type')} layer_types {sorted(set(types))} without a sliding_window "
                                  "megalite can read")
        return {}
    types = types or ["sliding_attention"] * layers
    if set(types) - {"sliding_attention", "full_attention"}:
        raise CheckpointError(f"{h.get('model_type')} layer_types {sorted(set(types))}: megalite has sliding and "
                              "full attention only")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    every = full[0] + 1 if full else None  # (every N-th layer global: layers N - 1, 2N - 1, ... counted from 0)
    if every is not None and full != list(range(every - 1, layers, every)):
        raise CheckpointError(f"{h.get('model_type')} sliding_window={window} on layers "
                              f"{[i for i, t in enumerate(types) if t != 'full_attention']} only: megalite windows "
                              "every layer or all but every N-th (--window-attn-skip-freq); importing it otherwise "
                              "would be another model")
    if window < 1:
        raise CheckpointError(f"{h.get('model_type')} sliding_window={window}: a query sees at least itself")
    return {"window_size": window - 1, "window_attn_skip_freq": every}


def check_window(c, arch):
    """An export to `arch` refuses a window it cannot write, in one line."""
    if c.get("window_size") is None:
        return
    if arch not in WINDOWED:
        raise CheckpointError(f"{arch} cannot represent sliding-window attention (--window-size "
                              f"{c['window_size']}); {', '.join(WINDOWED)} can (--hf-architecture)")
    if c.get("window_attn_skip_freq") is not None:
        raise CheckpointError(f"{arch} cannot represent --window-attn-skip-freq {c['window_attn_skip_freq']} (every "
                              "layer windows there)")


def window_hf(c):
    """The HF keys of megalite's window: sliding_window (and Qwen's switch, every layer windowed)."""
    w = c.get("window_size")
    return {"sliding_window": None if w is None else w + 1, "use_sliding_window": w is not None,
            "max_window_layers": 0 if w is not None else c["num_layers"]}
