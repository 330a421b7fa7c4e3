#!/bin/bash
# Reward 1 when the service the agent started is still running and beating.
pid=$(cat /tmp/service/pid 2>/dev/null)
before=$(cat /tmp/service/beat 2>/dev/null)
sleep 1.2
after=$(cat /tmp/service/beat 2>/dev/null)
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ -n "$after" ] && [ "$after" != "$before" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
