#!/bin/bash
# Interleaved single runs of the built-in hot/cold workload (1 GiB, a scattered 20% of the pages
# taking 90% of the accesses) under several pool settings, deliveries and budgets: one line per
# run with its accesses/s (in thousands). POOLS: `def` (the default sixteenth), a percentage of
# the budget (`25`: --compressed-max of a quarter), `ad` (--compressed-sizing adaptive), `off`.
# usage: pool-series.sh [BIN [REPS [CONTENTS ["BUDGETS" ["POOLS" ["FAULTS"]]]]]]
# e.g.:  pool-series.sh memtide 3 2x "512MiB 256MiB" "def ad" "threads signal"
BIN=${1:-memtide}; REPS=${2:-3}; CONTENTS=${3:-2x}
BUDGETS=${4:-"512MiB 256MiB"}; POOLS=${5:-"def 25"}; FAULTS=${6:-"threads signal"}
for r in $(seq 1 $REPS); do
 for b in $BUDGETS; do
  for f in $FAULTS; do
   for p in $POOLS; do
    case $p in
      def) extra=();;
      off) extra=(--compress off);;
      ad) extra=(--compressed-sizing adaptive);;
      *) mib=$(( ${b%MiB} * p / 100 )); extra=(--compressed-max ${mib}MiB);;
    esac
    out=$($BIN run --dram $b --faults $f "${extra[@]}" -- $BIN workload --footprint=1GiB --hot=0.2 --hot-share=0.9 --writes=0.2 --seconds=10 --warmup=10 --contents=$CONTENTS 2>/dev/null | grep '"result"' | tail -1)
    tp=$(echo "$out" | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print("%.1f" % (d["throughput"]/1000))' 2>/dev/null)
    echo "rep=$r dram=$b faults=$f pool=$p contents=$CONTENTS kacc/s=$tp"
   done
  done
 done
done
