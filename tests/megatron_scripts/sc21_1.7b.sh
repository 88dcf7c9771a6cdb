# Megatron-LM examples/academic_paper_scripts/sc21: run_table_1.sh's 1.7B case (its variables) and
# CONFIG.sh's MEGATRON_PARAMS verbatim, at commit d98e8a64dd. Paths come from the test:
# MEGATRON_DATA BPE_VOCAB_FILE BPE_MERGE_FILE. Its --activations-checkpoint-method is a flag Megatron
# itself renamed: megalite must point to the new name (and accept --DDP-impl with a notice).
TP=1
PP=1
MBS=16
GBS=512
NLS=24
HS=2304
NAH=24
DDP=torch
MEGATRON_EXTRA_PARAMS="--activations-checkpoint-method uniform "
MEGATRON_PARAMS=" ${MEGATRON_EXTRA_PARAMS} \
	--tensor-model-parallel-size ${TP} \
	--pipeline-model-parallel-size ${PP} \
	--micro-batch-size ${MBS} \
	--global-batch-size ${GBS} \
        --num-layers ${NLS} \
        --hidden-size ${HS} \
        --num-attention-heads ${NAH} \
	--DDP-impl ${DDP} \
	--data-path ${MEGATRON_DATA} \
	--vocab-file ${BPE_VOCAB_FILE} \
	--merge-file ${BPE_MERGE_FILE} \
        --log-interval 5 \
        --seq-length 2048 \
        --max-position-embeddings 2048 \
        --train-iters 500 \
        --lr-decay-iters 320 \
        --lr 0.0001 \
	--min-lr 0.00001 \
        --lr-decay-style cosine \
        --lr-warmup-fraction 0.01 \
        --split 969,30,1 \
        --eval-iters 100 \
        --eval-interval 1000 \
        --clip-grad 1.0 \
        --fp16 \
	--loss-scale 8192 "
ARGV=(${MEGATRON_PARAMS})
