#!/bin/bash
# interleaved A/B on the dev VM: A = 572d6cf (C planes), C = 572d6cf with numpy planes, B = working tree (C planes + PackFds)
out=/tmp/ab2; mkdir -p $out
py=/work/main/.venv/bin/python
for i in 1 2; do
  for v in A C B; do
    dir=/tmp/wt-a; [ $v = B ] && dir=/work/main
    ( cd $dir; if [ $v = C ]; then export GPUSNAP_NO_NATIVE=1; fi
      $py -m scripts.bench.bench_store --gb 2 --mix weights --rounds 1 --json $out/store-$v-$i.json > $out/store-$v-$i.log 2>&1 )
  done
done
for i in 1 2 3; do
  for v in A B C; do
    dir=/tmp/wt-a; [ $v = B ] && dir=/work/main
    ( cd $dir; if [ $v = C ]; then export GPUSNAP_NO_NATIVE=1; fi
      $py -m scripts.bench.bench_moe_delta --gb 1 --workers 2 --json $out/md-$v-$i.json > $out/md-$v-$i.log 2>&1 )
  done
done
echo done > $out/finished
