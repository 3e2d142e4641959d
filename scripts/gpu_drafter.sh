#!/usr/bin/env bash
# The SmolLM2 drafter trained on a lent GPU (the device tool: one call carries at most 64 MiB, machines start bare and
# nothing there reaches the package index). The target's GGUF (94 MiB) does not fit one call, so it travels in three
# parts with a slimmed working tree, the third with the wheels the GPU image lacks and the training job itself.
# The machine stays warm 30 s after a call: make the three calls one after the other.
#
#   here:   scripts/gpu_drafter.sh prepare     # .device/ (ignored): the wheels, the GGUF in parts, their checksum
#           scripts/gpu_drafter.sh slim        # move what no call needs (tests, docs, the tiny pair) to .device/held
#   device: run(carry=[".device/gguf-a"], command="scripts/gpu_drafter.sh keep .device/gguf-a")
#           run(carry=[".device/gguf-b"], command="scripts/gpu_drafter.sh keep .device/gguf-b")
#           run(carry=[".device/gguf-c", ".device/wheels", ".device/gguf.sha256"], timeout_s=600,
#               command="scripts/gpu_drafter.sh train")
#   here:   scripts/gpu_drafter.sh restore     # the slimmed files back
#
# `train` continues the bundled drafter (`--init`) on the whole committed corpus with the target's features computed
# per batch (`--online-features`): BACKBONE_MINUTES (default 4) + AR_MINUTES (1.5) at BATCH_SIZE (64), LR (3e-4),
# EXTRA (more train-drafter arguments). The drafter, the work folder's summary and the log come back under $OUT.
# A dry run here (the same job, small): PYTHON=.venv/bin/python DEVICE=cpu WHEELS_INSTALLED=1 BACKBONE_MINUTES=0.3
# AR_MINUTES=0.2 BATCH_SIZE=2 OUT=/tmp/out scripts/gpu_drafter.sh train (after `prepare` and a `keep` of parts a, b).
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE_DIR=.device
LIMIT_MIB=64
MARGIN_MIB=2  # (untracked files, rounding)
SLIMMED=(tests docs hub_cards treeflash_hf/reference_models/target treeflash_hf/reference_models/drafter
         treeflash_hf/reference_models/draft_lm treeflash_hf/reference_models/tokenizer)
WHEELS=(transformers==5.24.0 gguf==0.19.0 regex==2026.12.2)  # what the GPU image lacks or has too old
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PARTS_THERE=/tmp/treeflash-gguf

mib() { du -sb "$@" | awk '{s += $1} END {printf "%.1f", s / 1048576}'; }

travelling_mib() {  # tracked files present plus untracked files git does not ignore: what every call sends
  git ls-files -z --cached --others --exclude-standard | xargs -0 du -sb 2>/dev/null |
    awk '{s += $1} END {printf "%.1f", s / 1048576}'
}

prepare() {
  mkdir -p "$DEVICE_DIR/wheels"
  grep -qx "/$DEVICE_DIR/" .git/info/exclude 2>/dev/null || echo "/$DEVICE_DIR/" >> .git/info/exclude
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEVICE_DIR/wheels" "${WHEELS[@]}"
  local gguf
  gguf=$(.venv/bin/python -c "from treeflash_hf.recipes.pairs import smollm2_gguf; print(smollm2_gguf())")
  (cd "$(dirname "$gguf")" && sha256sum "$GGUF_NAME") > "$DEVICE_DIR/gguf.sha256"
  # part c rides with the wheels and a slimmed tree; a and b split the rest
  local tree wheels total c ab
  tree=$(git ls-files -z | grep -z -v -E "^($(IFS='|'; echo "${SLIMMED[*]}"))/" | xargs -0 du -sb |
         awk '{s += $1} END {print s}')
  wheels=$(du -sb "$DEVICE_DIR/wheels" | cut -f1)
  total=$(stat -c %s "$gguf")
  c=$(( (LIMIT_MIB - MARGIN_MIB) * 1048576 - tree - wheels ))
  ab=$(( (total - c + 1) / 2 ))
  if (( c <= 0 || ab + tree > (LIMIT_MIB - MARGIN_MIB) * 1048576 )); then
    echo "error: the slimmed tree ($(( tree / 1048576 )) MiB) leaves too little room for the GGUF in three calls" \
         "of $LIMIT_MIB MiB: slim more (SLIMMED in $0)." >&2
    exit 1
  fi
  rm -f "$DEVICE_DIR"/gguf-?
  split -b "$ab" -a 1 "$gguf" "$DEVICE_DIR/gguf-"  # gguf-a, gguf-b (ab bytes each), gguf-c (the rest, <= c)
  echo "prepared $DEVICE_DIR: wheels $(mib "$DEVICE_DIR/wheels") MiB; GGUF parts $(mib "$DEVICE_DIR/gguf-a")," \
       "$(mib "$DEVICE_DIR/gguf-b"), $(mib "$DEVICE_DIR/gguf-c") MiB; slimmed tree $(( tree / 1048576 )) MiB"
}

slim() {
  local dirty
  dirty=$(git status --porcelain -- "${SLIMMED[@]}")
  if [[ -n "$dirty" ]]; then
    echo "error: uncommitted changes under the paths slim moves away; commit them first:" >&2
    echo "$dirty" >&2
    exit 1
  fi
  mkdir -p "$DEVICE_DIR/held"
  for path in "${SLIMMED[@]}"; do
    mkdir -p "$DEVICE_DIR/held/$(dirname "$path")"
    mv "$path" "$DEVICE_DIR/held/$path"
  done
  echo "slimmed: every call now sends $(travelling_mib) MiB before its carry (restore with: $0 restore)"
}

restore() {
  for path in "${SLIMMED[@]}"; do
    if [[ -e "$DEVICE_DIR/held/$path" ]]; then
      mkdir -p "$(dirname "$path")"
      mv "$DEVICE_DIR/held/$path" "$path"
    fi
  done
  git checkout -- "${SLIMMED[@]}"  # (whatever is still missing, from the last commit)
  echo "restored: $(git status --porcelain -- "${SLIMMED[@]}" | wc -l) changed paths under the slimmed folders"
}

keep() {  # on the device: a GGUF part, kept outside the working tree until the train call
  mkdir -p "$PARTS_THERE"
  cp "$1" "$PARTS_THERE/"
  ls -la "$PARTS_THERE"
}

train() {  # on the device
  local out=${OUT:-/tmp/treeflash-out}
  mkdir -p "$out" "$PARTS_THERE"
  cp "$DEVICE_DIR/gguf-c" "$PARTS_THERE/"
  cat "$PARTS_THERE/gguf-a" "$PARTS_THERE/gguf-b" "$PARTS_THERE/gguf-c" > "$PARTS_THERE/$GGUF_NAME"
  (cd "$PARTS_THERE" && sha256sum -c "$OLDPWD/$DEVICE_DIR/gguf.sha256")
  if [[ -z "${WHEELS_INSTALLED:-}" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$DEVICE_DIR"/wheels/*.whl
  fi
  export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TREEFLASH_SMOLLM2_GGUF="$PARTS_THERE/$GGUF_NAME"
  export TREEFLASH_CACHE=/tmp/treeflash-cache TOKENIZERS_PARALLELISM=false
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
  "${PYTHON:-python3}" -m treeflash_hf.cli reference train-drafter --device "${DEVICE:-cuda}" --online-features --work /tmp/treeflash-work \
    --init treeflash_hf/reference_models/smollm2_drafter --stages windows backbone ar export \
    --code-tokens 300000 --heldout-windows 24 --chat-fraction 0.8 --threads "${THREADS:-8}" \
    --batch-size "${BATCH_SIZE:-64}" --lr "${LR:-3e-4}" \
    --backbone-minutes "${BACKBONE_MINUTES:-4}" --ar-minutes "${AR_MINUTES:-1.5}" \
    --out "$out/drafter" ${EXTRA:-} 2>&1 | tr '\r' '\n' | grep -v -E "it/s\]$|s/it\]$" | tee "$out/train.log"
  cp /tmp/treeflash-work/summary.json "$out/summary.json"
  ls -la "$out" "$out/drafter"
}

case "${1:-}" in
  prepare) prepare ;;
  slim) slim ;;
  restore) restore ;;
  keep) keep "$2" ;;
  train) train ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
