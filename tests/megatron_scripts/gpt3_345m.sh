# Megatron-LM examples/pretrain_gpt_distributed.sh ("Runs the 345M parameter model"), as of commit
# f2e72c8a16^ (its last version, 2024): the flag strings verbatim and the torchrun line's order.
# Paths come from the test: CHECKPOINT_PATH VOCAB_FILE MERGE_FILE DATA_PATH.
GPT_ARGS="
    --num-layers 24 \
    --hidden-size 1024 \
    --num-attention-heads 16 \
    --seq-length 1024 \
    --max-position-embeddings 1024 \
    --micro-batch-size 8 \
    --global-batch-size 64 \
    --lr 0.00015 \
    --train-iters 500000 \
    --lr-decay-iters 320000 \
    --lr-decay-style cosine \
    --min-lr 1.0e-5 \
    --weight-decay 1e-2 \
    --lr-warmup-fraction .01 \
    --clip-grad 1.0 \
    --fp16
"

DATA_ARGS="
    --data-path $DATA_PATH \
    --vocab-file $VOCAB_FILE \
    --merge-file $MERGE_FILE \
    --split 949,50,1
"

OUTPUT_ARGS="
    --log-interval 100 \
    --save-interval 10000 \
    --eval-interval 1000 \
    --eval-iters 10
"

ARGV=($GPT_ARGS $DATA_ARGS $OUTPUT_ARGS --distributed-backend nccl --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH)
