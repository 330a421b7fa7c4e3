#!/usr/bin/env bash
# Set up this checkout from nothing: the Debian packages Gyre needs at run time, the virtual
# environment at .venv, and Gyre installed into it (editable, with the cpu and test extras).
# Re-runnable: a second run reuses what the first installed and returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'setup: %s\n' "$*" >&2; }

# Mooncake's Transfer Engine links libibverbs even for TCP transfers.
APT_PACKAGES=(libibverbs1 ibverbs-providers)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  [[ $EUID -eq 0 ]] || { log "missing Debian packages ${missing[*]}: install them as root"; exit 1; }
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null
  apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

PY=$(command -v python3.11 || command -v python3)
[[ $("$PY" -c 'import sys; print(sys.version_info[:2] == (3, 11))') == True ]] \
  || { log "Gyre needs Python 3.11; $PY is $("$PY" --version)"; exit 1; }
[[ -x .venv/bin/python ]] || { log "creating .venv"; "$PY" -m venv .venv; }

# Reinstall only when the declared dependencies change.
stamp=.venv/.gyre-setup-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  log "installing Gyre and its dependencies into .venv"
  .venv/bin/python -m pip install -q -U pip
  # torch==2.13.0 resolves to the CPU build on this machine's disk; GPU sites pre-install CUDA torch.
  .venv/bin/python -m pip install -q -e '.[cpu,test]'
  echo "$want" >"$stamp"
fi
log "ready: $(.venv/bin/python -c 'import torch, megatron.core, gyre; print("torch", torch.__version__, "megatron-core", megatron.core.__version__)')"
