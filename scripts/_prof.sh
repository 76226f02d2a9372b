python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
for cfg in "gate_up 3 16,6 2" "gate_up 4 16,6 2"; do
  set -- $cfg
  ncu --kernel-name regex:gemv --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats --page source --csv --print-source sass python3 scripts/profile_gemv.py $cfg > $OUT/src_$1_$2.csv 2>&1
  ncu --kernel-name regex:gemv --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy python3 scripts/profile_gemv.py $cfg 2>&1 | grep -E "Duration|DRAM Throughput|Issued Warp|Eligible Warps|Active Warps|Warp Cycles Per Issued|Achieved Occ|SM Frequency"
done
