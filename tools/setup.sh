#!/usr/bin/env bash
# Set up this checkout from nothing: the Debian packages Gyre needs at run time, the virtual
# environment at .venv, and Gyre installed into it (editable, with the cpu and test extras).
# Re-runnable: a second run reuses what the first installed and returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'setup: %s\n' "$*" >&2; }

# Mooncake's Transfer Engine links libibverbs even for TCP transfers; bubblewrap isolates harness sandboxes;
# podman (with runc, its network stack and iptables) runs Harbor tasks that need an image
# (harness.isolation=podman); debootstrap makes the local image of their tests (tools/podman-test-image).
APT_PACKAGES=(libibverbs1 ibverbs-providers bubblewrap podman runc netavark iptables debootstrap)

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

# crun (podman's default OCI runtime on Debian 12) refuses a hybrid cgroup layout whose v2 tree has
# controllers ("cgroups in hybrid mode not supported"); runc runs there. Root only: the system's containers.conf.
RUNC_CONF=/etc/containers/containers.conf.d/gyre-runc.conf
if [[ $EUID -eq 0 && ! -f $RUNC_CONF ]] && grep -qs . /sys/fs/cgroup/unified/cgroup.controllers; then
  log "hybrid cgroups with v2 controllers: podman runs containers with runc ($RUNC_CONF)"
  mkdir -p "$(dirname "$RUNC_CONF")"
  printf '[engine]\nruntime = "runc"\n' >"$RUNC_CONF"
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
  .venv/bin/python -m pip install -q -e '.[cpu,test,harness]'
  echo "$want" >"$stamp"
fi
# Claude Code, pinned, for the proxy's harness tests: an npm package kept inside the venv (ignored
# by git); it runs offline against the proxy. Without npm those tests skip.
CLAUDE_CODE_VERSION=2.1.220
claude=.venv/harness/node_modules/.bin/claude
if [[ $("$claude" --version 2>/dev/null) != "$CLAUDE_CODE_VERSION"* ]]; then
  if command -v npm >/dev/null; then
    log "installing Claude Code $CLAUDE_CODE_VERSION into .venv/harness"
    npm install --prefix .venv/harness --no-audit --no-fund --loglevel=error "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" >/dev/null
  else
    log "npm not found: Claude Code harness tests will be skipped"
  fi
fi
# Codex CLI, pinned, the same way (it speaks the Responses API; its binary comes in an npm package).
CODEX_VERSION=0.171.0
codex=.venv/harness/node_modules/.bin/codex
if [[ $("$codex" --version 2>/dev/null) != *"$CODEX_VERSION" ]]; then
  if command -v npm >/dev/null; then
    log "installing Codex CLI $CODEX_VERSION into .venv/harness"
    npm install --prefix .venv/harness --no-audit --no-fund --loglevel=error "@openai/codex@$CODEX_VERSION" >/dev/null
  else
    log "npm not found: Codex harness tests will be skipped"
  fi
fi
# Qwen Code, pinned, the same way (a Node script speaking chat completions; it asks for Node 22 and
# runs on 20).
QWEN_CODE_VERSION=0.24.4
qwen=.venv/harness/node_modules/.bin/qwen
if [[ $("$qwen" --version 2>/dev/null) != "$QWEN_CODE_VERSION" ]]; then
  if command -v npm >/dev/null; then
    log "installing Qwen Code $QWEN_CODE_VERSION into .venv/harness"
    npm install --prefix .venv/harness --no-audit --no-fund --loglevel=error "@qwen-code/qwen-code@$QWEN_CODE_VERSION" >/dev/null
  else
    log "npm not found: Qwen Code harness tests will be skipped"
  fi
fi
log "ready: $(.venv/bin/python -c 'import torch, megatron.core, gyre; print("torch", torch.__version__, "megatron-core", megatron.core.__version__)')"
