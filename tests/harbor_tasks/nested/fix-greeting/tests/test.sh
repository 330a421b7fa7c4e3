#!/bin/bash
# Partial credit: one half per name greeted right (the workdir is /srv/greet here).
cd /srv/greet || exit 1
ok=0
for n in Ada Linus; do
  [ "$(bash greet.sh "$n")" = "Hello, $n!" ] && ok=$((ok + 1))
done
rewards=(0 0.5 1)
echo "${rewards[$ok]}" > /logs/verifier/reward.txt
