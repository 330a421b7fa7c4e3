#!/bin/bash
# Shared by both steps' verifiers (the task's tests/, under each step's own at /tests).
# lines N: whether $NOTES holds "one" .. N in order (N = 1 or 2).
lines() {
  local want=("one" "two")
  mapfile -t got < "$NOTES" 2>/dev/null || return 1
  [ "${#got[@]}" = "$1" ] || return 1
  for i in $(seq 0 $(($1 - 1))); do [ "${got[$i]}" = "${want[$i]}" ] || return 1; done
}
