#!/bin/bash
# Reward 1 when /app/hello.txt says hello, else 0 (reward.txt: one number).
if [ "$(cat /app/hello.txt 2>/dev/null | tr -d '[:space:]')" = "hello" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
