#!/usr/bin/env bash
# The host-work change (DepthCache.step_pools, the lean per-layer checks) against its parent, paired in one process
# per row (benchmarks/journal/host/swap_ab.py).  Models: the bundled one; /tmp/ouro-mid and /tmp/iquest-mid as built
# by benchmarks/ouro_batch.py and benchmarks/iquest_vllm.py.
set -euo pipefail
cd "$(dirname "$0")/../../.."
BASE=${BASE:-da5bf1a}
SWAP=dasspec.model.layers:kernel_pair,dasspec.model.layers:NormedBlock.plain_parts,dasspec.model.layers:Attention.row_args,\
dasspec.model.layers:GatedMLP.row_args,dasspec.model.layers:RMSNorm.takes_kernel,dasspec.model.linear:kernel_takes,\
dasspec.model.families.recurrence:_layers_and_pools
OURO=${OURO:-/tmp/ouro-mid}; IQUEST=${IQUEST:-/tmp/iquest-mid}
echo "| model | method | B | new / old speed, median [range] | old | new | tokens |"
echo "|---|---|---|---|---|---|---|"
for m in ar das-wave mature-spec; do
  python benchmarks/journal/host/swap_ab.py --base "$BASE" --swap "$SWAP" --method $m --batch 1 --rounds 6
done
for m in ar das-wave auto; do
  python benchmarks/journal/host/swap_ab.py --base "$BASE" --swap "$SWAP" --method $m --batch 8 --rounds 4
done
for m in ar auto; do
  python benchmarks/journal/host/swap_ab.py --base "$BASE" --swap "$SWAP" --model "$OURO" --method $m --batch 8 --tokens 32 --rounds 4
done
python benchmarks/journal/host/swap_ab.py --base "$BASE" --swap "$SWAP" --model "$OURO" --method ar --batch 1 --tokens 32 --rounds 4
python benchmarks/journal/host/swap_ab.py --base "$BASE" --swap "$SWAP" --model "$IQUEST" --method ar --batch 8 --tokens 32 --rounds 4
