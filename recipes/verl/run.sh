#!/usr/bin/env bash
# Launch a stratarl recipe on veRL (needs veRL with vLLM and GPUs; see docs/verl.md).
#
#   bash recipes/verl/run.sh [--dry-run] RECIPE [hydra overrides...]
#   RECIPE: stratified_grpo | so_grpo | stratified_so_grpo
#   --dry-run: compose and validate the config with veRL's loader (every key, the tool, the reward,
#              the agent loop), print the settings, and stop before any worker starts (CPU is enough;
#              no data, server or GPU needed).
#
# Before: data in $STRATARL_VERL_DATA (default ./data/verl): train.parquet and test.parquet from
#   stratarl verl convert-data <Search-R1 file> data/verl/train.parquet --split train
# and a retrieval server at $STRATARL_RETRIEVER_URL (default http://127.0.0.1:8000/retrieve):
#   stratarl serve ...
# Example (4 GPUs, smaller model):
#   bash recipes/verl/run.sh stratified_grpo trainer.n_gpus_per_node=4 \
#       actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B-Instruct
set -euo pipefail

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
RECIPE="${1:-}"
if [ -z "$RECIPE" ]; then
    echo "usage: bash recipes/verl/run.sh [--dry-run] stratified_grpo|so_grpo|stratified_so_grpo [hydra overrides...]" >&2
    exit 2
fi
shift
RECIPE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ ! -f "$RECIPE_DIR/$RECIPE.yaml" ] || [[ "$RECIPE" == part_* ]] || [ "$RECIPE" = search_r1_base ]; then
    echo "error: unknown recipe '$RECIPE'; choose stratified_grpo, so_grpo or stratified_so_grpo" >&2
    exit 2
fi

export STRATARL_VERL_RECIPE_DIR="$RECIPE_DIR"
export STRATARL_VERL_DATA="${STRATARL_VERL_DATA:-$PWD/data/verl}"
export STRATARL_RETRIEVER_URL="${STRATARL_RETRIEVER_URL:-http://127.0.0.1:8000/retrieve}"
# The driver imports the plugins too (the recipe also passes this to every Ray worker).
export VERL_USE_EXTERNAL_MODULES="stratarl.integrations.verl${VERL_USE_EXTERNAL_MODULES:+,$VERL_USE_EXTERNAL_MODULES}"
PYTHON="${PYTHON:-python3}"

if [ "$DRY_RUN" = 1 ]; then
    exec "$PYTHON" -m stratarl.integrations.verl.dry_run --config-dir "$RECIPE_DIR" --config-name "$RECIPE" "$@"
fi

for split in train test; do
    if [ ! -f "$STRATARL_VERL_DATA/$split.parquet" ]; then
        echo "error: $STRATARL_VERL_DATA/$split.parquet not found; create it with" >&2
        echo "  stratarl verl convert-data <your Search-R1 $split file> $STRATARL_VERL_DATA/$split.parquet" >&2
        echo "(or set STRATARL_VERL_DATA to the folder that has train.parquet and test.parquet)" >&2
        exit 2
    fi
done

HEALTH_URL="${STRATARL_RETRIEVER_URL%/retrieve}/health"
if ! "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$HEALTH_URL" 2>/dev/null; then
    echo "error: no retrieval server answers at $HEALTH_URL; start one, e.g." >&2
    echo "  stratarl serve --index <your index>   (or set STRATARL_RETRIEVER_URL)" >&2
    exit 2
fi

"$PYTHON" -m stratarl.cli verl check

exec "$PYTHON" -m verl.trainer.main_ppo \
    --config-path="$RECIPE_DIR" --config-name="$RECIPE" "$@"
