# Megatron-LM tests/functional_tests/test_cases/gpt/gpt3_7b_tp1_pp4_memory_speed/model_config.yaml
# at commit d98e8a64dd: MODEL_ARGS verbatim, one flag per line as its functional-test
# launcher passes them (true: the bare switch). Paths come from the test's environment
# (DATA_PATH TENSORBOARD_PATH CHECKPOINT_SAVE_PATH CHECKPOINT_LOAD_PATH DATA_CACHE_PATH).
ARGV=(
    --num-layers 32
    --hidden-size 4096
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --untie-embeddings-and-output-weights
    --log-throughput
    --log-params-norm
    --log-num-zeros-in-grad
    --log-validation-ppl-to-tensorboard
    --log-timers-to-tensorboard
    --tensorboard-dir "${TENSORBOARD_PATH}"
    --micro-batch-size 1
    --global-batch-size 8
    --seq-length 8192
    --max-position-embeddings 8192
    --train-iters 25
    --timing-log-level 0
    --lr-decay-iters 320000
    --save "${CHECKPOINT_SAVE_PATH}"
    --load "${CHECKPOINT_LOAD_PATH}"
    --tokenizer-type NullTokenizer
    --vocab-size 131073
    --mock-data
    --split 949,50,1
    --distributed-backend nccl
    --lr 0.00015
    --lr-decay-style cosine
    --min-lr 1e-05
    --weight-decay 1e-2
    --clip-grad 1.0
    --lr-warmup-fraction 0.01
    --log-interval 2
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 5
    --transformer-impl transformer_engine
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 4
    --num-layers-per-virtual-pipeline-stage 1
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --deterministic-mode
    --no-gradient-accumulation-fusion
    --use-mcore-models
    --ckpt-format torch_dist
    --dist-ckpt-strictness log_all
    --data-cache-path "${DATA_CACHE_PATH}"
    --bf16
    --log-memory-to-tensorboard
    --exit-interval 25
    --async-save
    --use-persistent-ckpt-worker
)
