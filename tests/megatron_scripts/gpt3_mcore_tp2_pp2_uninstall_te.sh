# Megatron-LM tests/functional_tests/test_cases/gpt/gpt3_mcore_tp2_pp2_uninstall_te/model_config.yaml
# at commit d98e8a64dd: MODEL_ARGS verbatim, one flag per line as its functional-test
# launcher passes them (true: the bare switch). Paths come from the test's environment
# (DATA_PATH TENSORBOARD_PATH CHECKPOINT_SAVE_PATH CHECKPOINT_LOAD_PATH DATA_CACHE_PATH).
ARGV=(
    --num-layers 12
    --hidden-size 512
    --num-attention-heads 8
    --log-params-norm
    --log-num-zeros-in-grad
    --log-validation-ppl-to-tensorboard
    --log-timers-to-tensorboard
    --tensorboard-dir "${TENSORBOARD_PATH}"
    --micro-batch-size 4
    --global-batch-size 32
    --seq-length 1024
    --max-position-embeddings 1024
    --train-iters 50
    --timing-log-level 0
    --lr-decay-iters 320000
    --save "${CHECKPOINT_SAVE_PATH}"
    --load "${CHECKPOINT_LOAD_PATH}"
    --data-path "${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document"
    --vocab-file "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json"
    --merge-file "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt"
    --split 949,50,1
    --distributed-backend nccl
    --lr 0.00015
    --lr-decay-style cosine
    --min-lr 1e-05
    --weight-decay 1e-2
    --clip-grad 1.0
    --lr-warmup-fraction 0.01
    --log-interval 1
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
    --transformer-impl local
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --no-persist-layer-norm
    --no-masked-softmax-fusion
    --deterministic-mode
    --no-gradient-accumulation-fusion
    --use-mcore-models
    --ckpt-format torch_dist
    --dist-ckpt-strictness log_all
    --data-cache-path "${DATA_CACHE_PATH}"
    --fp16
    --apply-query-key-layer-scaling
    --log-memory-to-tensorboard
    --async-save
    --use-persistent-ckpt-worker
)
