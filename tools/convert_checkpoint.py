"""Convert checkpoints (Megatron's converter flags): megalite at another TP/PP, or to/from Hugging Face.

    # reshard offline (model and optimizer state)
    python tools/convert_checkpoint.py --loader megalite --saver megalite --load-dir ckpt --save-dir ckpt_tp4 \\
        --target-tensor-parallel-size 4 --target-pipeline-parallel-size 1
    # export: GPT2LMHeadModel (learned positions, LayerNorm), LlamaForCausalLM (rope, RMSNorm, SwiGLU),
    # BertForPreTraining (pretrain_bert.py checkpoints), or for MoE models MixtralForCausalLM,
    # Qwen2MoeForCausalLM (a gated shared expert) and Qwen3MoeForCausalLM (--qk-layernorm)
    python tools/convert_checkpoint.py --loader megalite --saver hf --load-dir ckpt --save-dir hf_out
    # continue a Megatron-LM run: its torch_dist --save directory (any TP/PP) at its iteration
    python tools/convert_checkpoint.py --loader megatron --saver megalite --load-dir megatron_ckpt --save-dir ckpt
    # and back to Megatron-LM (its --load reads it at any TP/PP; the vocabulary padded for
    # --target-tensor-parallel-size)
    python tools/convert_checkpoint.py --loader megalite --saver megatron --load-dir ckpt --save-dir megatron_ckpt
    # import a save_pretrained directory (safetensors) as a megalite "release" checkpoint
    python tools/convert_checkpoint.py --loader hf --saver megalite --load-dir hf_dir --save-dir ckpt \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2

megalite checkpoints load at any TP/PP/DP whatever layout they were written in; resharding
lays the files out as the target job writes them. Conversion streams tensor by tensor.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.checkpoint.convert import find_checkpoint, import_megatron, reshard  # noqa: E402
from megalite.checkpoint.hf_convert import export_hf, import_hf  # noqa: E402
from megalite.checkpoint.storage import CheckpointError  # noqa: E402
from megalite.errors import ConfigError  # noqa: E402


def build_parser():
    p = argparse.ArgumentParser(description="Convert megalite / Hugging Face checkpoints (Megatron's converter flags)",
                                allow_abbrev=False)
    p.add_argument("--model-type", default=None, type=str.upper, choices=["GPT", "BERT"],
                   help="the model family (GPT: GPT2LMHeadModel / LlamaForCausalLM / Mixtral / Qwen2-MoE / Qwen3-MoE; "
                        "BERT: BertForPreTraining); "
                        "megalite and HF checkpoints record it themselves")
    p.add_argument("--loader", required=True, choices=["megalite", "hf", "megatron"],
                   help="format of --load-dir (megatron: a Megatron-LM --save directory in its torch_dist format)")
    p.add_argument("--saver", required=True, choices=["megalite", "hf", "megatron"],
                   help="format to write to --save-dir (megatron: a Megatron-LM torch_dist --save directory, read "
                        "by Megatron-LM's --load at any TP/PP)")
    p.add_argument("--load-dir", required=True, help="megalite: the --save directory (with "
                   "latest_checkpointed_iteration.txt); hf: a save_pretrained directory")
    p.add_argument("--save-dir", required=True, help="where to write the converted checkpoint")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, help="TP layout of the megalite files")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, help="PP layout of the megalite files")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="vocabulary padding recorded for an imported HF model (Megatron's default 128)")
    p.add_argument("--no-load-optim", action="store_true",
                   help="--loader megatron: the weights, iteration and data position only (as Megatron's flag)")
    p.add_argument("--max-shard-size-mb", type=int, default=1024, help="--saver hf: largest safetensors shard")
    p.add_argument("--hf-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="--saver hf: the weights' dtype (default the model's; float32 from a --bf16/--fp16 run: the "
                        "fp32 main weights its checkpoint holds)")
    p.add_argument("--hf-architecture", default=None,
                   help="--saver hf: the class to write where more than one holds the model (MistralForCausalLM for "
                        "a Llama; default: the class an imported checkpoint came from, else the model's own)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.target_tensor_parallel_size < 1 or args.target_pipeline_parallel_size < 1:
            raise CheckpointError("target parallel sizes must be >= 1")
        if args.loader == "hf" and args.saver == "hf":
            raise CheckpointError("--loader hf --saver hf converts nothing; pick megalite for one side")
        for flag, given in (("--hf-architecture", args.hf_architecture), ("--hf-dtype", args.hf_dtype)):
            if given and args.saver != "hf":
                raise CheckpointError(f"{flag} is --saver hf's; drop it for --saver {args.saver}")
        if not os.path.isdir(args.load_dir):
            raise CheckpointError(f"--load-dir {args.load_dir} is not a directory")
        if args.loader == "megalite":
            find_checkpoint(args.load_dir)  # not a megalite checkpoint: one line, before any work
            if args.saver == "megalite":
                reshard(args.load_dir, args.save_dir, args.target_tensor_parallel_size,
                        args.target_pipeline_parallel_size)
            elif args.saver == "megatron":  # (its vocabulary padded as Megatron pads it at the target TP)
                from megalite.checkpoint.to_megatron import export_megatron
                export_megatron(args.load_dir, args.save_dir, args.target_tensor_parallel_size)
            else:
                export_hf(args.load_dir, args.save_dir, args.max_shard_size_mb << 20,
                          args.model_type.lower() if args.model_type else None, args.hf_architecture, args.hf_dtype)
        elif args.loader == "megatron":
            if args.saver != "megalite":
                raise CheckpointError("--loader megatron converts to megalite (--saver megalite); export to HF from "
                                      "there")
            from megalite.cli.megatron_args import model_config_of
            src, optim = import_megatron(args.load_dir, args.save_dir, args.target_tensor_parallel_size,
                                         args.target_pipeline_parallel_size, model_config_of, not args.no_load_optim)
            print(f"convert_checkpoint: Megatron-LM iteration {src.iteration} ({src.consumed()[0]} samples consumed): "
                  "weights, iteration and data position" + (", Adam's state, LR schedule and loss scale" if optim else
                                                             " (no optimizer state)"))
        else:
            import_hf(args.load_dir, args.save_dir, args.target_tensor_parallel_size,
                      args.target_pipeline_parallel_size, args.make_vocab_size_divisible_by)
    except (CheckpointError, ConfigError, ValueError) as e:
        print(f"convert_checkpoint: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"convert_checkpoint: wrote {args.saver} checkpoint to {args.save_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
