#!/bin/bash
# Reward 1 when the workdir's file, the file under /etc and the running service are all there.
pid=$(cat /var/tmp/beat.pid 2>/dev/null)
before=$(cat /var/tmp/beat 2>/dev/null)
sleep 1.2
after=$(cat /var/tmp/beat 2>/dev/null)
if [ "$(pwd)" = /testbed ] && [ "$(cat status.txt 2>/dev/null)" = fixed ] && [ "$(cat /etc/gyre-fixed 2>/dev/null)" = fixed ] \
  && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ -n "$after" ] && [ "$after" != "$before" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
